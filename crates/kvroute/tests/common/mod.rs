//! Helpers shared by the process-level tests (each test file includes this module).

use std::process::Child;

/// A child process killed and reaped when dropped, so a failing test leaves nothing running.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An ephemeral loopback port, released for a child process to bind (a tiny window in which
/// another process could take it; acceptable for a test on loopback).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("ephemeral port")
}
