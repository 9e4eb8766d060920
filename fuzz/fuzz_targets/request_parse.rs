//! Fuzzes request parsing (`kvroute_protocol::openai`): the first byte picks the API (chat
//! completions, completions, SGLang `/generate`), the second and third the token-id limit,
//! the rest is the body. Parsing must return routing info or a 4xx error naming a field —
//! never panic, and never hold more token ids than the limit.
#![no_main]

use kvroute_protocol::openai::{Api, parse_limited, parse_value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [sel, l0, l1, body @ ..] = data else { return };
    let api = match sel % 3 {
        0 => Api::Chat,
        1 => Api::Completions,
        _ => Api::Generate,
    };
    let limit = usize::from(u16::from_le_bytes([*l0, *l1])).max(1);
    let session = (sel & 0x80 != 0).then_some("session-1");
    match parse_limited(api, body, session, limit) {
        Ok(info) => {
            if let Some(ids) = &info.token_ids {
                assert!(ids.len() <= limit, "{} ids kept over a limit of {limit}", ids.len());
            }
        }
        Err(e) => assert!(e.status.is_client_error(), "{e:?}"),
    }
    let _ = parse_value(body);
});
