//! `kvroute replay` (being built).

/// Flags of `kvroute replay`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kvroute replay`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`kvroute replay` is not built yet")
}
