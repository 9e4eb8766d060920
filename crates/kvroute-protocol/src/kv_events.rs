//! Engine KV-cache events in vLLM's wire format (`vllm/distributed/kv_events.py` in
//! github.com/vllm-project/vllm): the msgpack
//! codec (both the legacy positional and the current map encoding of events, array or map
//! batches, u64 or bytes hashes, SGLang's rank slot) and the 3-frame ZeroMQ message
//! (`[topic, seq as 8-byte big-endian, payload]`).
//!
//! Decoding never panics: malformed input is an error naming what was wrong; unknown event
//! types and fields are skipped and counted in [`DecodeStats`].

use bytes::Bytes;
use rmpv::Value;

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks were stored.
    BlockStored {
        /// Engine block hashes, one per block (u64 form; byte digests are cut to their low 64 bits).
        block_hashes: Vec<u64>,
        /// Engine hash of the block before the first one (`None`: the chain starts at the root).
        parent_block_hash: Option<u64>,
        /// Token ids of the blocks, `block_hashes.len() × block_size` of them.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Storage tier (`"GPU"`, `"CPU"`, …) when given.
        medium: Option<String>,
        /// KV-cache group (0 = the main full-attention group).
        group_idx: u32,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Engine block hashes.
        block_hashes: Vec<u64>,
        /// Storage tier, when given.
        medium: Option<String>,
        /// KV-cache group.
        group_idx: u32,
    },
    /// Every block of this worker was dropped.
    AllBlocksCleared,
}

/// A batch of events (one ZeroMQ message).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp, seconds.
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank (vLLM) or attention-DP rank (SGLang), when given.
    pub dp_rank: Option<i64>,
}

/// How events are encoded inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Positional arrays, tag first (vLLM before mid-2026, SGLang); the batch is an array.
    Legacy,
    /// Maps with a `"type"` key (current vLLM); the batch is a map.
    Map,
}

/// What decoding skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Events of an unknown type.
    pub unknown_events: u64,
    /// Map fields not understood.
    pub unknown_fields: u64,
}

/// A malformed batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KV event batch: {0}")]
pub struct DecodeError(pub String);

fn err<T>(m: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(m.into()))
}

fn hash_of(v: &Value, what: &str) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| DecodeError(format!("{what}: bad integer"))),
        Value::Binary(b) => {
            // Low 64 bits of the digest, as vLLM's integer form.
            let mut x = [0u8; 8];
            let n = b.len().min(8);
            x[8 - n..].copy_from_slice(&b[b.len() - n..]);
            Ok(u64::from_be_bytes(x))
        }
        _ => err(format!("{what}: expected an integer or bytes")),
    }
}

fn hashes(v: &Value, what: &str) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::Array(a) => a.iter().map(|x| hash_of(x, what)).collect(),
        _ => err(format!("{what}: expected an array")),
    }
}

fn opt_hash(v: Option<&Value>) -> Result<Option<u64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => hash_of(x, "parent_block_hash").map(Some),
    }
}

fn tokens(v: Option<&Value>) -> Result<Vec<u32>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|x| *x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(|| DecodeError("token_ids: not a token id".into()))
            })
            .collect(),
        Some(_) => err("token_ids: expected an array"),
    }
}

fn opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

fn small(v: Option<&Value>) -> u32 {
    v.and_then(Value::as_u64).map_or(0, |x| x.min(u32::MAX as u64) as u32)
}

fn decode_event(v: &Value, stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    match v {
        Value::Array(a) => {
            let Some(tag) = a.first().and_then(Value::as_str) else { return err("event: array without a tag") };
            let f = |i: usize| a.get(i);
            match tag {
                // ["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]
                "BlockStored" => Ok(Some(KvEvent::BlockStored {
                    block_hashes: hashes(f(1).unwrap_or(&Value::Nil), "block_hashes")?,
                    parent_block_hash: opt_hash(f(2))?,
                    token_ids: tokens(f(3))?,
                    block_size: small(f(4)),
                    medium: opt_str(f(6)),
                    group_idx: small(f(9)),
                })),
                // ["BlockRemoved", block_hashes, medium, group_idx?]
                "BlockRemoved" => Ok(Some(KvEvent::BlockRemoved {
                    block_hashes: hashes(f(1).unwrap_or(&Value::Nil), "block_hashes")?,
                    medium: opt_str(f(2)),
                    group_idx: small(f(3)),
                })),
                "AllBlocksCleared" => Ok(Some(KvEvent::AllBlocksCleared)),
                _ => {
                    stats.unknown_events += 1;
                    Ok(None)
                }
            }
        }
        Value::Map(m) => {
            let get = |k: &str| m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v);
            let Some(tag) = get("type").and_then(Value::as_str) else { return err("event: map without `type`") };
            let known: &[&str] = match tag {
                "BlockStored" => &[
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                    "kv_cache_spec_kind",
                ],
                "BlockRemoved" => &["type", "block_hashes", "medium", "group_idx", "kv_cache_spec_kind"],
                "AllBlocksCleared" => &["type", "medium"],
                _ => {
                    stats.unknown_events += 1;
                    return Ok(None);
                }
            };
            stats.unknown_fields +=
                m.iter().filter(|(k, _)| k.as_str().is_none_or(|k| !known.contains(&k))).count() as u64;
            match tag {
                "BlockStored" => Ok(Some(KvEvent::BlockStored {
                    block_hashes: hashes(get("block_hashes").unwrap_or(&Value::Nil), "block_hashes")?,
                    parent_block_hash: opt_hash(get("parent_block_hash"))?,
                    token_ids: tokens(get("token_ids"))?,
                    block_size: small(get("block_size")),
                    medium: opt_str(get("medium")),
                    group_idx: small(get("group_idx")),
                })),
                "BlockRemoved" => Ok(Some(KvEvent::BlockRemoved {
                    block_hashes: hashes(get("block_hashes").unwrap_or(&Value::Nil), "block_hashes")?,
                    medium: opt_str(get("medium")),
                    group_idx: small(get("group_idx")),
                })),
                _ => Ok(Some(KvEvent::AllBlocksCleared)),
            }
        }
        _ => err("event: expected an array or a map"),
    }
}

/// Decodes a msgpack payload (array or map batch, either event encoding).
///
/// # Errors
/// [`DecodeError`] for anything that is not a batch.
pub fn decode(payload: &[u8]) -> Result<(EventBatch, DecodeStats), DecodeError> {
    let mut cur = payload;
    let v = rmpv::decode::read_value(&mut cur).map_err(|e| DecodeError(format!("not msgpack: {e}")))?;
    let (ts, events, rank) = match &v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => {
            let get = |k: &str| m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v);
            (get("ts"), get("events"), get("data_parallel_rank").or_else(|| get("attn_dp_rank")))
        }
        _ => return err("batch: expected an array or a map"),
    };
    let ts = ts.and_then(|t| t.as_f64().or_else(|| t.as_i64().map(|x| x as f64))).unwrap_or(0.0);
    let Some(Value::Array(evs)) = events else { return err("batch: `events` is not an array") };
    let mut stats = DecodeStats::default();
    let mut out = Vec::with_capacity(evs.len());
    for e in evs {
        if let Some(ev) = decode_event(e, &mut stats)? {
            out.push(ev);
        }
    }
    let dp_rank = rank.and_then(Value::as_i64);
    Ok((EventBatch { ts, events: out, dp_rank }, stats))
}

fn u64s(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|x| Value::from(*x)).collect())
}

fn encode_event(e: &KvEvent, enc: Encoding) -> Value {
    let s = |x: &str| Value::from(x);
    let opt = |x: &Option<String>| x.as_deref().map_or(Value::Nil, Value::from);
    match (e, enc) {
        (
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, group_idx },
            Encoding::Legacy,
        ) => Value::Array(vec![
            s("BlockStored"),
            u64s(block_hashes),
            parent_block_hash.map_or(Value::Nil, Value::from),
            Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
            Value::from(*block_size),
            Value::Nil,
            opt(medium),
            Value::Nil,
            Value::Array(vec![Value::Nil]),
            Value::from(*group_idx),
        ]),
        (
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, group_idx },
            Encoding::Map,
        ) => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), u64s(block_hashes)),
            (s("parent_block_hash"), parent_block_hash.map_or(Value::Nil, Value::from)),
            (s("token_ids"), Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect())),
            (s("block_size"), Value::from(*block_size)),
            (s("lora_id"), Value::Nil),
            (s("medium"), opt(medium)),
            (s("lora_name"), Value::Nil),
            (s("extra_keys"), Value::Array(vec![Value::Nil])),
            (s("group_idx"), Value::from(*group_idx)),
            (s("kv_cache_spec_kind"), s("full_attention")),
        ]),
        (KvEvent::BlockRemoved { block_hashes, medium, group_idx }, Encoding::Legacy) => {
            Value::Array(vec![s("BlockRemoved"), u64s(block_hashes), opt(medium), Value::from(*group_idx)])
        }
        (KvEvent::BlockRemoved { block_hashes, medium, group_idx }, Encoding::Map) => Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), u64s(block_hashes)),
            (s("medium"), opt(medium)),
            (s("group_idx"), Value::from(*group_idx)),
        ]),
        (KvEvent::AllBlocksCleared, Encoding::Legacy) => Value::Array(vec![s("AllBlocksCleared")]),
        (KvEvent::AllBlocksCleared, Encoding::Map) => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
    }
}

/// Encodes a batch: an array `[ts, events, dp_rank]` (legacy) or a map (current vLLM).
pub fn encode(batch: &EventBatch, enc: Encoding) -> Vec<u8> {
    let events = Value::Array(batch.events.iter().map(|e| encode_event(e, enc)).collect());
    let rank = batch.dp_rank.map_or(Value::Nil, Value::from);
    let v = match enc {
        Encoding::Legacy => Value::Array(vec![Value::F64(batch.ts), events, rank]),
        Encoding::Map => Value::Map(vec![
            (Value::from("ts"), Value::F64(batch.ts)),
            (Value::from("events"), events),
            (Value::from("data_parallel_rank"), rank),
        ]),
    };
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

/// The 3 frames of one published batch.
pub fn frames(topic: &str, seq: u64, payload: Bytes) -> Vec<Bytes> {
    vec![Bytes::copy_from_slice(topic.as_bytes()), Bytes::copy_from_slice(&seq.to_be_bytes()), payload]
}

/// Splits a received message into (topic, seq, payload).
///
/// # Errors
/// [`DecodeError`] when it is not 3 frames with an 8-byte sequence.
pub fn parse_frames(frames: &[Bytes]) -> Result<(String, u64, Bytes), DecodeError> {
    let [topic, seq, payload] = frames else { return err(format!("expected 3 frames, got {}", frames.len())) };
    let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| DecodeError("sequence frame is not 8 bytes".into()))?;
    Ok((String::from_utf8_lossy(topic).into_owned(), u64::from_be_bytes(seq), payload.clone()))
}

/// Replay end marker sequence (`-1` as a signed 8-byte big-endian integer).
pub const REPLAY_END: [u8; 8] = (-1i64).to_be_bytes();

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EventBatch {
        EventBatch {
            ts: 12.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX - 1, 7],
                    parent_block_hash: Some(15_760_518_052_499_183_552),
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    medium: Some("GPU".into()),
                    group_idx: 0,
                },
                KvEvent::BlockRemoved { block_hashes: vec![3], medium: Some("GPU".into()), group_idx: 0 },
                KvEvent::AllBlocksCleared,
            ],
            dp_rank: Some(0),
        }
    }

    #[test]
    fn round_trip_in_both_encodings() {
        for enc in [Encoding::Legacy, Encoding::Map] {
            let bytes = encode(&sample(), enc);
            let (b, stats) = decode(&bytes).expect("decodes");
            assert_eq!(b, sample(), "{enc:?}");
            assert_eq!(stats, DecodeStats::default());
        }
    }

    #[test]
    fn spec_variants_bytes_hashes_unknowns_and_sglang_rank() {
        // Legacy array batch built field by field from the spec, with a bytes hash, an
        // extra trailing field, an unknown event type and SGLang's rank in the third slot.
        let digest: Vec<u8> = (1..=32).collect();
        let v = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::Binary(digest.clone())]),
                    Value::Nil,
                    Value::Array((0..16).map(Value::from).collect()),
                    Value::from(16),
                    Value::Nil,
                    Value::from("GPU"),
                    Value::Nil,
                    Value::Array(vec![Value::Nil]),
                    Value::from(0),
                    Value::from("full_attention"),
                    Value::from("a future field"),
                ]),
                Value::Array(vec![Value::from("SomethingNew"), Value::from(1)]),
                Value::Map(vec![
                    (Value::from("type"), Value::from("BlockRemoved")),
                    (Value::from("block_hashes"), Value::Array(vec![Value::from(9)])),
                    (Value::from("new_field"), Value::from(true)),
                ]),
            ]),
            Value::from(3),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &v).expect("encode");
        let (b, stats) = decode(&bytes).expect("decodes");
        assert_eq!(b.dp_rank, Some(3));
        assert_eq!(stats, DecodeStats { unknown_events: 1, unknown_fields: 1 });
        let low = u64::from_be_bytes(digest[24..32].try_into().expect("8"));
        assert!(matches!(&b.events[0], KvEvent::BlockStored { block_hashes, .. } if block_hashes == &vec![low]));
        assert_eq!(b.events[1], KvEvent::BlockRemoved { block_hashes: vec![9], medium: None, group_idx: 0 });
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let bad: [&[u8]; 5] = [b"", b"\xc1", b"\x93\x01", b"\x92\xcb", b"\xa3abc"];
        for c in bad {
            assert!(decode(c).is_err(), "{c:?}");
        }
        // A well-formed batch whose only event is of an unknown type: skipped and counted.
        let (b, stats) = decode(b"\x93\x00\x91\x92\xa3xyz\x01\xc0").expect("valid batch");
        assert!(b.events.is_empty());
        assert_eq!(stats.unknown_events, 1);
        // Deterministic pseudo-random bytes: never panics.
        let mut x = 0x1234_5678_u64;
        for _ in 0..2000 {
            let n = (x % 64) as usize;
            let buf: Vec<u8> = (0..n)
                .map(|i| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407 + i as u64);
                    (x >> 33) as u8
                })
                .collect();
            let _ = decode(&buf);
        }
        assert!(parse_frames(&[Bytes::from_static(b"t")]).is_err());
        let f = frames("kv", 42, Bytes::from_static(b"p"));
        assert_eq!(parse_frames(&f).expect("3 frames").1, 42);
    }
}
