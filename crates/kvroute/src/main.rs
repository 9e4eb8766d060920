//! `kvroute`: the command line of the kvroute KV-cache-aware LLM router.
//!
//! Thin: each subcommand parses its flags and calls into the library crates.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

mod cmd_advise;
mod cmd_bench;
mod cmd_bench_decision;
mod cmd_bench_kv_events;
mod cmd_bench_kv_zmq;
mod cmd_demo;
mod cmd_engine_sim;
mod cmd_policies;
mod cmd_profile;
mod cmd_register;
mod cmd_replay;
mod cmd_serve;
mod sim_args;

/// KV-cache-aware request router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Demo: 4 simulated engines + the gateway, a Mooncake slice over HTTP, round_robin vs cache-aware.
    Demo(cmd_demo::Args),
    /// One simulated inference worker over HTTP (vLLM-like metrics and endpoints).
    EngineSim(cmd_engine_sim::Args),
    /// Run the router gateway in front of inference workers.
    Serve(Box<cmd_serve::Args>),
    /// Replay a request trace through every policy on simulated engines.
    Replay(cmd_replay::Args),
    /// Which policy and knobs fit a trace (e.g. one recorded with `serve --record`), from
    /// replays over several arrival realisations.
    Advise(cmd_advise::Args),
    /// Load generator (trace or synthetic, open or closed loop), and `bench compare` with peer routers.
    Bench(Box<cmd_bench::Args>),
    /// List every routing policy with its knobs, defaults and source.
    Policies(cmd_policies::Args),
    /// Engine profiles: their constants and predicted prefill times (`profile show`).
    Profile(cmd_profile::Args),
    /// Keep a worker registered in the cluster registry (etcd) while its /health passes.
    Register(cmd_register::Args),
}

/// Logs to stderr: `KVROUTE_LOG` (an `EnvFilter` directive such as `debug` or
/// `kvroute_gateway=debug`) or by default `info` for the long-running servers and `warn`
/// for the one-shot commands, whose output is their report.
fn init_logging(cmd: &Command) {
    let default = match cmd {
        Command::Serve(_) | Command::EngineSim(_) | Command::Register(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVROUTE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

/// mimalloc (Microsoft's allocator, small C library): the proxy allocates and frees many
/// small buffers per request across threads; glibc malloc showed ~10 % of the router's CPU
/// in `perf` at concurrency 32 (docs/benchmarks.md, "Proxy overhead").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Ends the process quietly, with success as `kvroute policies` does, when printing to
/// stdout fails on a closed pipe: `kvroute replay … | head` closes it before the tool is
/// done (the reader has what it wanted), and `println!` then panics ("failed printing to
/// stdout: Broken pipe"), which printed a panic message and a backtrace. Every other panic
/// goes to the default hook. (Rust ignores SIGPIPE, so sockets get an error rather than the
/// signal; this keeps it that way.)
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg =
            payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.starts_with("failed printing to stdout") && m.contains("Broken pipe")) {
            std::process::exit(0);
        }
        default(info);
    }));
}

fn main() -> std::process::ExitCode {
    quiet_broken_pipe();
    let cli = Cli::parse();
    init_logging(&cli.command);
    let result = match cli.command {
        Command::Demo(a) => cmd_demo::run(a),
        Command::EngineSim(a) => cmd_engine_sim::run(a),
        Command::Serve(a) => cmd_serve::run(*a),
        Command::Replay(a) => cmd_replay::run(a),
        Command::Advise(a) => cmd_advise::run(a),
        Command::Policies(a) => cmd_policies::run(a),
        Command::Profile(a) => cmd_profile::run(a),
        Command::Bench(a) => cmd_bench::run(*a),
        Command::Register(a) => cmd_register::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
