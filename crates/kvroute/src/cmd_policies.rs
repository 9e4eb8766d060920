//! `kvroute policies` (being built).

/// Flags of `kvroute policies`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kvroute policies`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`kvroute policies` is not built yet")
}
