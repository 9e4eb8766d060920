//! A real same-host reverse proxy for the admin-access tests: the Debian `nginx-light`
//! binary, given by `KVROUTE_NGINX_BIN`, started in the foreground with a generated
//! configuration on a free 127.0.0.1 port, proxying to one upstream with the headers the
//! usual deployment guides set (`X-Forwarded-For`, `X-Real-IP`); killed on drop.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The nginx binary from `KVROUTE_NGINX_BIN`; fails the test, naming the package, without it.
pub fn nginx_binary() -> String {
    match std::env::var("KVROUTE_NGINX_BIN") {
        Ok(p) if std::path::Path::new(&p).is_file() => p,
        _ => panic!(
            "this test needs a real reverse proxy: install the Debian package nginx-light and run it with \
             KVROUTE_NGINX_BIN=$(command -v nginx) (scripts/test.sh does when nginx is installed)"
        ),
    }
}

/// A running nginx; killed (and its directory removed) on drop.
pub struct Nginx {
    child: Child,
    /// Its prefix directory; removed when dropped, after `Drop` killed the child.
    dir: tempfile::TempDir,
    /// Its URL, `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Nginx {
    /// Starts nginx on a free port in front of `upstream` (`127.0.0.1:PORT`) and waits
    /// (bounded) until it answers.
    pub async fn start(upstream: &str) -> Nginx {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let dir = tempfile::Builder::new().prefix(&format!("kvroute-nginx-{port}-")).tempdir().expect("nginx dir");
        let d = dir.path().display();
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://{upstream};\n\
             proxy_set_header Host $host;\n      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
             proxy_set_header X-Real-IP $remote_addr;\n    }}\n  }}\n}}\n"
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).expect("nginx.conf");
        let child = Command::new(nginx_binary())
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&conf_path)
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        let mut n = Nginx { child, dir, url: format!("http://127.0.0.1:{port}") };
        for _ in 0..400 {
            if let Some(status) = n.child.try_wait().expect("wait for nginx") {
                panic!("nginx exited at start ({status}); its log:\n{}", n.log());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("nginx on {port} did not accept within 20 s; its log:\n{}", n.log());
    }

    /// nginx's error log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `dir` is removed after this, when the fields drop.
    }
}
