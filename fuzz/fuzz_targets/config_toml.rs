//! Fuzzes the gateway's configuration file (`GatewayConfig::from_toml`, which also
//! validates): any text must give a configuration or an error naming a key — never panic.
#![no_main]

use kvroute_gateway::GatewayConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(cfg) = GatewayConfig::from_toml(text) {
        // A configuration that parsed is valid.
        assert!(cfg.validate().is_ok());
    }
});
