//! Fuzzes the API-key file parser (`kvroute_gateway::api_keys::ApiKeys::parse`): any text
//! must give keys or an error naming the line — never panic.
#![no_main]

use kvroute_gateway::api_keys::ApiKeys;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = ApiKeys::parse(text, 60, 0);
});
