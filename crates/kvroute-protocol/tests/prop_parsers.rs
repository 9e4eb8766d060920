//! Property tests of request parsing (`kvroute_protocol::openai`), beside the cargo-fuzz
//! targets (`fuzz/fuzz_targets/request_parse.rs`): any bytes or any JSON value give routing
//! info or a 4xx naming a field, and valid requests keep the fields routing reads.

use kvroute_protocol::openai::{Api, parse_limited};
use proptest::prelude::*;

const APIS: [Api; 3] = [Api::Chat, Api::Completions, Api::Generate];

/// Any JSON value, a few levels deep.
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
        // The field names routing reads, so objects hit them often.
        prop_oneof![Just("model"), Just("messages"), Just("prompt"), Just("input_ids"), Just("text")]
            .prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        Just("model".to_string()),
                        Just("messages".to_string()),
                        Just("prompt".to_string()),
                        Just("input_ids".to_string()),
                        Just("text".to_string()),
                        Just("stream".to_string()),
                        Just("max_tokens".to_string()),
                        Just("user".to_string()),
                        Just("role".to_string()),
                        Just("content".to_string()),
                        "[a-z_]{1,8}",
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn any_bytes_give_info_or_a_client_error(body in prop::collection::vec(any::<u8>(), 0..512), api in 0usize..3) {
        if let Err(e) = parse_limited(APIS[api], &body, None, 64) {
            prop_assert!(e.status.is_client_error(), "{e:?}");
            prop_assert!(e.param.is_some(), "the error names a field: {e:?}");
        }
    }

    #[test]
    fn any_json_gives_info_or_a_client_error_and_never_more_ids_than_the_limit(
        v in json(), api in 0usize..3, limit in 1usize..8,
    ) {
        let body = serde_json::to_vec(&v).expect("serialise");
        match parse_limited(APIS[api], &body, None, limit) {
            Ok(info) => prop_assert!(info.token_ids.is_none_or(|ids| ids.len() <= limit)),
            Err(e) => prop_assert!(e.status.is_client_error(), "{e:?}"),
        }
    }

    #[test]
    fn a_chat_request_keeps_model_stream_limits_session_and_every_message(
        model in "[a-zA-Z0-9/._-]{1,24}",
        contents in prop::collection::vec(".{0,40}", 1..6),
        stream in any::<bool>(),
        max_tokens in any::<u32>(),
        session in prop::option::of("[a-z0-9]{1,12}"),
    ) {
        let messages: Vec<serde_json::Value> =
            contents.iter().map(|c| serde_json::json!({"role": "user", "content": c})).collect();
        let body = serde_json::json!({"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens});
        let parsed = parse_limited(Api::Chat, body.to_string().as_bytes(), session.as_deref(), 64);
        if contents.iter().all(String::is_empty) {
            // No message has content: there is no prompt, refused naming the field.
            let e = parsed.expect_err("an empty conversation");
            prop_assert_eq!(e.param.as_deref(), Some("messages"));
            return Ok(());
        }
        let info = parsed.expect("valid");
        prop_assert_eq!(&info.model, &model);
        prop_assert_eq!(info.stream, stream);
        prop_assert_eq!(info.max_tokens, Some(max_tokens));
        prop_assert_eq!(info.session, session);
        for c in &contents {
            prop_assert!(info.text.contains(c.as_str()), "{:?} not in {:?}", c, info.text);
        }
    }

    #[test]
    fn token_id_prompts_are_kept_up_to_the_limit_and_refused_beyond(
        ids in prop::collection::vec(any::<u32>(), 1..40), limit in 1usize..40, generate in any::<bool>(),
    ) {
        let (api, body) = if generate {
            (Api::Generate, serde_json::json!({"input_ids": ids}))
        } else {
            (Api::Completions, serde_json::json!({"model": "m", "prompt": ids}))
        };
        match parse_limited(api, body.to_string().as_bytes(), None, limit) {
            Ok(info) => {
                prop_assert!(ids.len() <= limit);
                prop_assert_eq!(info.token_ids, Some(ids));
            }
            Err(e) => {
                prop_assert!(ids.len() > limit, "refused within the limit: {e:?}");
                prop_assert_eq!(e.status.as_u16(), 400);
            }
        }
    }
}
