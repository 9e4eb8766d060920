//! kvroute's load generator, the engine of `kvroute bench`.
//!
//! - [`workload`]: the requests to send, each with its send time: from a trace (Mooncake,
//!   session JSONL, Azure) with prompt text synthesised deterministically from the trace's
//!   `hash_ids` (shared block ids mean shared text), or synthetic (Poisson, constant rate,
//!   llm-d's shared-prefix groups).
//! - [`runner`]: sends them over HTTP to any OpenAI-compatible endpoint (kvroute, a peer
//!   router, a worker), open loop by timestamp or closed loop at a fixed concurrency,
//!   streaming, and records per request TTFT, inter-token latencies, E2E, usage
//!   (`cached_tokens`), the status and the serving worker (`x-kvroute-worker`).
//! - [`summary`]: percentiles, throughput, goodput at an SLO, errors and rejections
//!   (429/503/529 counted apart, never hidden), per-worker shares, a terminal table.
//! - [`compare`]: `kvroute bench compare` — kvroute and the peer routers (sglang-router,
//!   vllm-router, SMG) started in turn in front of the same workers, one table.
//! - [`overhead`]: proxy overhead measured by `wrk`, an external C client, against instant
//!   workers directly and through each router (`kvroute bench overhead`).
//! - [`cli`]: the flags and helpers `kvroute bench` and `kvroute bench compare` share.
//!
//! Everything is bounded: in-flight requests by a semaphore, each request by a timeout, the
//! run by a request count and an optional duration.

pub mod cli;
pub mod compare;
pub mod epp_gateway;
pub mod overhead;
pub mod runner;
pub mod summary;
pub mod workload;

/// An ephemeral loopback port, released for another socket or a child process to bind (a
/// tiny window in which another process could take it; acceptable on loopback). Never one
/// this process was given before: the kernel can hand the same port to two binds in a
/// row once the first is released, and two sockets of a test (a ZeroMQ PUB and its replay
/// ROUTER) then got one port between them.
///
/// # Errors
/// The bind's error.
pub fn free_port() -> std::io::Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
}
