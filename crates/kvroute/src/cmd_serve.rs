//! `kvroute serve` (being built).

/// Flags of `kvroute serve`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kvroute serve`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`kvroute serve` is not built yet")
}
