//! `kvroute policies`: every routing policy with its knobs, defaults and source.

use kvroute_core::registry;

/// Flags of `kvroute policies`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON (an array of policies with their knobs) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvroute policies`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let list = registry::list();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    for p in &list {
        println!("{:<16} {}", p.name, p.summary);
        println!("{:<16} source: {}", "", p.source);
        for k in &p.knobs {
            println!("{:<18}{:<26} = {:<12} [{}] {}", "", k.name, k.default.to_string(), k.unit, k.doc);
        }
        println!();
    }
    Ok(())
}
