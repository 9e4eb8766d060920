//! `kvroute policies`: every routing policy with its knobs, defaults and source.

use kvroute_core::registry;
use std::io::Write;

/// Flags of `kvroute policies`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON (an array of policies with their knobs) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvroute policies`. A reader that stops early (`kvroute policies | head`) ends the
/// listing quietly: a broken pipe is success, not a panic.
///
/// # Errors
/// Any other failure to write standard output.
pub fn run(args: Args) -> anyhow::Result<()> {
    match write_list(&mut std::io::stdout().lock(), args.json) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn write_list(out: &mut impl Write, json: bool) -> std::io::Result<()> {
    let list = registry::list();
    if json {
        serde_json::to_writer_pretty(&mut *out, &list)?;
        writeln!(out)?;
        return out.flush();
    }
    for p in &list {
        writeln!(out, "{:<16} {}", p.name, p.summary)?;
        writeln!(out, "{:<16} source: {}", "", p.source)?;
        for k in &p.knobs {
            writeln!(out, "{:<18}{:<26} = {:<12} [{}] {}", "", k.name, k.default.to_string(), k.unit, k.doc)?;
        }
        writeln!(out)?;
    }
    out.flush()
}
