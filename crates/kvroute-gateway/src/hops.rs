//! Routing loops. A router listed (directly, or through another router) as its own worker
//! sent each request back to itself until something else gave out: one probe recursed 259
//! times and used up the model's whole admission budget. Two guards:
//!
//! - Every request sent to a worker carries a `Via` header (RFC 9110 §7.6.3) with the
//!   request's own `Via` entries and then this hop's, `1.1 kvroute-<replica id>`. A request
//!   that arrives already naming this replica has been here before: it is answered
//!   508 Loop Detected (RFC 5842) without being dispatched ([`check_arrival`]), and a
//!   worker answering 508 ends the request with that answer instead of being retried, so
//!   a chain of routers pointing at each other is cut after one round.
//! - `/add_worker`, the etcd registry and `worker_urls` (at start and on SIGHUP) refuse a
//!   worker URL that points at one of this router's own listeners ([`own_listener`]).
//!
//! Envoy (`Via` with its `via` setting) and nginx (`proxy_set_header Via`) add the same
//! header; neither refuses its own address as an upstream.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header::VIA};
use kvroute_protocol::api_error::ApiError;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// The protocol part of this router's `Via` entry (RFC 9110: the received protocol's
/// version; the router speaks HTTP/1.1 to workers).
pub const VIA_PROTOCOL: &str = "1.1";

/// Longest `Via` accepted from a client, bytes (all its lines together). A chain this long
/// (some hundred hops) is a loop through something that does not keep `Via`; it is answered
/// 508 rather than carried further.
pub const MAX_VIA_BYTES: usize = 4096;

/// This replica's name in `Via`: `kvroute-<replica id>`.
pub fn via_name(replica_id: &str) -> String {
    format!("kvroute-{replica_id}")
}

/// The `Via` entries of `headers` (every `Via` line, split at commas), trimmed.
fn entries(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(VIA)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|e| !e.is_empty())
}

/// Whether a `Via` entry of `headers` names `name` as the recipient (the entry's second
/// word, compared case-insensitively).
pub fn names(headers: &HeaderMap, name: &str) -> bool {
    entries(headers).any(|e| e.split_whitespace().nth(1).is_some_and(|by| by.eq_ignore_ascii_case(name)))
}

/// A request arriving at the replica called `name`: refused when it has passed here
/// before, or when its `Via` is longer than [`MAX_VIA_BYTES`].
///
/// # Errors
/// 508 Loop Detected, naming the replica.
pub fn check_arrival(headers: &HeaderMap, name: &str) -> Result<(), ApiError> {
    let len: usize = headers.get_all(VIA).iter().map(|v| v.len()).sum();
    if len > MAX_VIA_BYTES {
        return Err(ApiError::new(
            StatusCode::LOOP_DETECTED,
            format!("the request's `Via` is longer than {MAX_VIA_BYTES} bytes: too many hops, probably a loop"),
        ));
    }
    if names(headers, name) {
        return Err(ApiError::new(
            StatusCode::LOOP_DETECTED,
            format!(
                "routing loop: this request already passed through this router (`Via: {VIA_PROTOCOL} {name}`); \
                 a worker URL of this router, or of a router it sends to, points back at it"
            ),
        ));
    }
    Ok(())
}

/// The `Via` to send to a worker: the request's own entries, then `1.1 <name>`.
pub fn outgoing(headers: &HeaderMap, name: &str) -> HeaderValue {
    let mut v = String::new();
    for e in entries(headers) {
        v.push_str(e);
        v.push_str(", ");
    }
    v.push_str(VIA_PROTOCOL);
    v.push(' ');
    v.push_str(name);
    // Every piece came from a valid header value or is a token; the fallback is never hit.
    HeaderValue::from_str(&v).unwrap_or_else(|_| HeaderValue::from_static("1.1 kvroute"))
}

/// Whether a connection to `ip:port` reaches a socket bound to `bound` on this host:
/// the same port, and the same address, or `bound` is a wildcard (`0.0.0.0`, `[::]`) and
/// `ip` is one of this host's addresses. Connecting to `0.0.0.0` or `[::]` reaches
/// loopback.
pub fn reaches(ip: IpAddr, port: u16, bound: SocketAddr) -> bool {
    if port != bound.port() {
        return false;
    }
    let ip = ip.to_canonical();
    let b = bound.ip().to_canonical();
    let ip_local = |ip: IpAddr| ip.is_loopback() || ip.is_unspecified() || is_local_address(ip);
    if b.is_unspecified() {
        return ip_local(ip);
    }
    ip == b || (ip.is_unspecified() && b.is_loopback())
}

/// Whether `ip` is an address of this host: the kernel picks `ip` itself as the source
/// address of a (connected, never sent on) UDP socket towards it only when it is local.
/// Loopback addresses are local without asking.
fn is_local_address(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    let any: SocketAddr = match ip {
        IpAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    std::net::UdpSocket::bind(any)
        .and_then(|s| {
            s.connect((ip, 9))?;
            s.local_addr()
        })
        .is_ok_and(|local| local.ip() == ip)
}

/// The listener of `bound` (this router's bound addresses) that the normalised worker URL
/// `url` points at, if any. An IP host is compared directly; `localhost` (and
/// `*.localhost`) is loopback; another name is resolved by the system resolver, bounded by
/// `timeout` (a name that does not resolve in time counts as not this router: `Via`
/// still catches the loop). Nothing is resolved unless the URL's port is one of `bound`'s.
pub async fn own_listener(url: &str, bound: &[SocketAddr], timeout: Duration) -> Option<SocketAddr> {
    let parsed = url::Url::parse(url).ok()?;
    let port = parsed.port_or_known_default()?;
    if !bound.iter().any(|b| b.port() == port) {
        return None;
    }
    let ips: Vec<IpAddr> = match parsed.host()? {
        url::Host::Ipv4(a) => vec![a.into()],
        url::Host::Ipv6(a) => vec![a.into()],
        url::Host::Domain(d) => {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            if d == "localhost" || d.ends_with(".localhost") {
                vec![std::net::Ipv4Addr::LOCALHOST.into(), std::net::Ipv6Addr::LOCALHOST.into()]
            } else {
                match tokio::time::timeout(timeout, tokio::net::lookup_host((d.as_str(), port))).await {
                    Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
                    _ => Vec::new(),
                }
            }
        }
    };
    bound.iter().copied().find(|b| ips.iter().any(|ip| reaches(*ip, port, *b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn via(lines: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(VIA, HeaderValue::from_str(l).expect("value"));
        }
        h
    }

    #[test]
    fn a_request_that_passed_here_is_refused_with_508() {
        let me = via_name("r1");
        assert!(check_arrival(&HeaderMap::new(), &me).is_ok());
        assert!(check_arrival(&via(&["1.1 kvroute-r2, 1.0 fred"]), &me).is_ok());
        assert!(check_arrival(&via(&["1.1 kvroute-r10"]), &me).is_ok(), "a prefix is another replica");
        for seen in
            [&["1.1 kvroute-r1"][..], &["1.0 nginx", "HTTP/1.1 KVROUTE-R1 (comment)"], &["1.1 a, 1.1 kvroute-r1"]]
        {
            let e = check_arrival(&via(seen), &me).unwrap_err();
            assert_eq!(e.status, StatusCode::LOOP_DETECTED, "{seen:?}");
        }
        let long = format!("1.1 {}", "x".repeat(MAX_VIA_BYTES));
        assert_eq!(check_arrival(&via(&[&long]), &me).unwrap_err().status, StatusCode::LOOP_DETECTED);
    }

    #[test]
    fn the_outgoing_via_keeps_the_entries_and_appends_this_hop() {
        assert_eq!(outgoing(&HeaderMap::new(), "kvroute-a"), "1.1 kvroute-a");
        assert_eq!(outgoing(&via(&["1.0 fred, 1.1 p", " 2 x "]), "kvroute-a"), "1.0 fred, 1.1 p, 2 x, 1.1 kvroute-a");
        assert!(names(&via(&[outgoing(&via(&["1.1 kvroute-b"]), "kvroute-a").to_str().expect("ascii")]), "kvroute-b"));
    }

    #[test]
    fn own_listener_addresses_are_recognised_wildcards_included() {
        let lo: SocketAddr = "127.0.0.1:30000".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:30000".parse().expect("addr");
        let any6: SocketAddr = "[::]:30000".parse().expect("addr");
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert!(reaches(ip("127.0.0.1"), 30000, lo));
        assert!(reaches(ip("::ffff:127.0.0.1"), 30000, lo));
        assert!(reaches(ip("0.0.0.0"), 30000, lo), "connecting to 0.0.0.0 reaches loopback");
        assert!(!reaches(ip("127.0.0.1"), 30001, lo), "another port");
        assert!(!reaches(ip("127.0.0.2"), 30000, lo), "another loopback address is another socket");
        for b in [any, any6] {
            assert!(reaches(ip("127.0.0.2"), 30000, b));
            assert!(reaches(ip("::1"), 30000, b));
            assert!(!reaches(ip("192.0.2.1"), 30000, b), "TEST-NET-1 is not this host");
        }
    }

    #[tokio::test]
    async fn worker_urls_pointing_at_a_listener_are_found() {
        let bound: Vec<SocketAddr> = vec!["127.0.0.1:30000".parse().expect("a"), "127.0.0.1:30001".parse().expect("b")];
        let t = Duration::from_secs(5);
        assert_eq!(own_listener("http://127.0.0.1:30000", &bound, t).await, Some(bound[0]));
        assert_eq!(own_listener("http://localhost:30001/v1", &bound, t).await, Some(bound[1]));
        assert_eq!(own_listener("https://0.0.0.0:30000", &bound, t).await, Some(bound[0]));
        assert_eq!(own_listener("http://127.0.0.1:30002", &bound, t).await, None);
        assert_eq!(own_listener("http://127.0.0.1", &bound, t).await, None, "port 80");
        assert_eq!(own_listener("http://[::1]:30000", &bound, t).await, None, "bound to IPv4 loopback only");
    }
}
