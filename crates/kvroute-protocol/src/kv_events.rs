//! Engine KV-cache events in vLLM's wire format (`vllm/distributed/kv_events.py` in
//! github.com/vllm-project/vllm): the msgpack
//! codec (both the legacy positional and the current map encoding of events, array or map
//! batches, u64 or bytes hashes, SGLang's rank slot) and the 3-frame ZeroMQ message
//! (`[topic, seq as 8-byte big-endian, payload]`).
//!
//! Decoding never panics: malformed input is an error naming what was wrong; unknown event
//! types and fields are skipped and counted in [`DecodeStats`].

use bytes::Bytes;
use rmp::Marker;
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

/// A payload that is not msgpack (truncated, a reserved marker, nested too deep).
fn not_msgpack(e: impl std::fmt::Display) -> DecodeError {
    DecodeError(format!("not msgpack: {e}"))
}

/// The marker of the next value, not consumed.
fn peek(rd: &[u8]) -> Result<Marker, DecodeError> {
    rd.first().map(|b| Marker::from_u8(*b)).ok_or_else(|| not_msgpack("truncated"))
}

/// Consumes the next value whatever it is and returns its bytes. Iterative (a count of the
/// items still to read), so it allocates nothing and no nesting can exhaust the stack; a
/// length past the payload's end is an error before anything is read. (rmp's
/// `MessageLen` would do this, but it panics on extension types.)
fn skip<'a>(rd: &mut &'a [u8]) -> Result<&'a [u8], DecodeError> {
    let start = *rd;
    let mut pending: u64 = 1;
    while pending > 0 {
        pending -= 1;
        let (bytes, items): (u64, u64) = match peek(rd)? {
            // The unused marker 0xc1 reads as nil, as rmpv reads it.
            Marker::Reserved | Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                (1, 0)
            }
            Marker::U8 | Marker::I8 => (2, 0),
            Marker::U16 | Marker::I16 => (3, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (5, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (9, 0),
            Marker::FixStr(n) => (1 + u64::from(n), 0),
            Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                (u64::from(rmp::decode::read_str_len(rd).map_err(not_msgpack)?), 0)
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                (u64::from(rmp::decode::read_bin_len(rd).map_err(not_msgpack)?), 0)
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                (0, u64::from(rmp::decode::read_array_len(rd).map_err(not_msgpack)?))
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                (0, 2 * u64::from(rmp::decode::read_map_len(rd).map_err(not_msgpack)?))
            }
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => (u64::from(rmp::decode::read_ext_meta(rd).map_err(not_msgpack)?.size), 0),
        };
        let n = usize::try_from(bytes).ok().filter(|n| *n <= rd.len()).ok_or_else(|| not_msgpack("truncated"))?;
        *rd = &rd[n..];
        pending += items;
        if pending > rd.len() as u64 {
            return Err(not_msgpack("truncated"));
        }
    }
    Ok(&start[..start.len() - rd.len()])
}

fn is_array(m: Marker) -> bool {
    matches!(m, Marker::FixArray(_) | Marker::Array16 | Marker::Array32)
}

fn is_map(m: Marker) -> bool {
    matches!(m, Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
}

/// Items of the array or pairs of the map just announced. An item takes a byte at least,
/// so a count the rest of the payload cannot hold is a truncated payload, an error before
/// anything is reserved for it.
fn len_of(rd: &mut &[u8], map: bool) -> Result<usize, DecodeError> {
    let n = if map { rmp::decode::read_map_len(rd) } else { rmp::decode::read_array_len(rd) }.map_err(not_msgpack)?;
    let n = n as usize;
    if n.saturating_mul(if map { 2 } else { 1 }) > rd.len() {
        return Err(not_msgpack("truncated"));
    }
    Ok(n)
}

/// A number, as rmpv's `Value` reads it (a non-negative signed integer is unsigned).
#[derive(Clone, Copy)]
enum Num {
    U(u64),
    Neg(i64),
    F(f64),
    /// Not a number (consumed).
    Other,
}

fn num(rd: &mut &[u8]) -> Result<Num, DecodeError> {
    Ok(match peek(rd)? {
        Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => {
            Num::U(rmp::decode::read_int(rd).map_err(not_msgpack)?)
        }
        Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
            let v: i64 = rmp::decode::read_int(rd).map_err(not_msgpack)?;
            u64::try_from(v).map_or(Num::Neg(v), Num::U)
        }
        Marker::F32 => Num::F(f64::from(rmp::decode::read_f32(rd).map_err(not_msgpack)?)),
        Marker::F64 => Num::F(rmp::decode::read_f64(rd).map_err(not_msgpack)?),
        _ => {
            skip(rd)?;
            Num::Other
        }
    })
}

/// A string (`None` for any other value, or invalid UTF-8, as rmpv's `as_str`).
fn str_of<'a>(rd: &mut &'a [u8]) -> Result<Option<&'a str>, DecodeError> {
    let v = skip(rd)?;
    if !matches!(Marker::from_u8(v[0]), Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) {
        return Ok(None);
    }
    let mut r = v;
    let n = rmp::decode::read_str_len(&mut r).map_err(not_msgpack)? as usize;
    Ok(r.get(..n).and_then(|b| std::str::from_utf8(b).ok()))
}

/// A block hash: an integer (a negative one as its two's complement) or the low 64 bits
/// of a byte digest.
fn hash_of(rd: &mut &[u8], what: &str) -> Result<u64, DecodeError> {
    match peek(rd)? {
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
            let n = rmp::decode::read_bin_len(rd).map_err(not_msgpack)? as usize;
            let b = rd.get(..n).ok_or_else(|| not_msgpack("truncated"))?;
            *rd = &rd[n..];
            // Low 64 bits of the digest, as vLLM's integer form.
            let mut x = [0u8; 8];
            let k = b.len().min(8);
            x[8 - k..].copy_from_slice(&b[b.len() - k..]);
            Ok(u64::from_be_bytes(x))
        }
        _ => match num(rd)? {
            Num::U(x) => Ok(x),
            Num::Neg(x) => Ok(x as u64),
            _ => err(format!("{what}: expected an integer or bytes")),
        },
    }
}

fn hashes(rd: &mut &[u8], what: &str) -> Result<Vec<u64>, DecodeError> {
    if !is_array(peek(rd)?) {
        return err(format!("{what}: expected an array"));
    }
    let n = len_of(rd, false)?;
    (0..n).map(|_| hash_of(rd, what)).collect()
}

fn opt_hash(rd: &mut &[u8]) -> Result<Option<u64>, DecodeError> {
    if matches!(peek(rd)?, Marker::Null | Marker::Reserved) {
        *rd = &rd[1..];
        return Ok(None);
    }
    hash_of(rd, "parent_block_hash").map(Some)
}

fn tokens(rd: &mut &[u8]) -> Result<Vec<u32>, DecodeError> {
    match peek(rd)? {
        Marker::Null | Marker::Reserved => {
            *rd = &rd[1..];
            Ok(Vec::new())
        }
        m if is_array(m) => {
            let n = len_of(rd, false)?;
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push(
                    rmp::decode::read_int::<u32, _>(rd).map_err(|_| DecodeError("token_ids: not a token id".into()))?,
                );
            }
            Ok(out)
        }
        _ => err("token_ids: expected an array"),
    }
}

/// A count or index: a non-negative integer (at most `u32::MAX`), else 0.
fn small(rd: &mut &[u8]) -> Result<u32, DecodeError> {
    Ok(match num(rd)? {
        Num::U(x) => x.min(u64::from(u32::MAX)) as u32,
        _ => 0,
    })
}

/// Map keys an event of a known type may carry ([`MAP_KNOWN`] picks per type).
const MAP_KEYS: [&str; 11] = [
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
];
const K_TYPE: usize = 0;
const K_HASHES: usize = 1;
const K_PARENT: usize = 2;
const K_TOKENS: usize = 3;
const K_BLOCK_SIZE: usize = 4;
const K_MEDIUM: usize = 6;
const K_GROUP: usize = 9;

/// The [`MAP_KEYS`] (as bits) known to each event type: `BlockStored` all, `BlockRemoved`
/// type, block_hashes, medium, group_idx and kv_cache_spec_kind, `AllBlocksCleared` type
/// and medium.
const MAP_KNOWN: [(&str, u16); 3] = [
    ("BlockStored", 0x7ff),
    ("BlockRemoved", 1 | 1 << 1 | 1 << 6 | 1 << 9 | 1 << 10),
    ("AllBlocksCleared", 1 | 1 << 6),
];

fn decode_array_event(rd: &mut &[u8], stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    let n = len_of(rd, false)?;
    if n == 0 {
        return err("event: array without a tag");
    }
    let Some(tag) = str_of(rd)? else { return err("event: array without a tag") };
    let mut ev = match tag {
        // ["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: Vec::new(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            medium: None,
            group_idx: 0,
        },
        // ["BlockRemoved", block_hashes, medium, group_idx?]
        "BlockRemoved" => KvEvent::BlockRemoved { block_hashes: Vec::new(), medium: None, group_idx: 0 },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        _ => {
            stats.unknown_events += 1;
            for _ in 1..n {
                skip(rd)?;
            }
            return Ok(None);
        }
    };
    if n < 2 && !matches!(ev, KvEvent::AllBlocksCleared) {
        return err("block_hashes: expected an array");
    }
    for i in 1..n {
        match (&mut ev, i) {
            (KvEvent::BlockStored { block_hashes, .. } | KvEvent::BlockRemoved { block_hashes, .. }, 1) => {
                *block_hashes = hashes(rd, "block_hashes")?;
            }
            (KvEvent::BlockStored { parent_block_hash, .. }, 2) => *parent_block_hash = opt_hash(rd)?,
            (KvEvent::BlockStored { token_ids, .. }, 3) => *token_ids = tokens(rd)?,
            (KvEvent::BlockStored { block_size, .. }, 4) => *block_size = small(rd)?,
            (KvEvent::BlockStored { medium, .. }, 6) | (KvEvent::BlockRemoved { medium, .. }, 2) => {
                *medium = str_of(rd)?.map(str::to_string);
            }
            (KvEvent::BlockStored { group_idx, .. }, 9) | (KvEvent::BlockRemoved { group_idx, .. }, 3) => {
                *group_idx = small(rd)?;
            }
            _ => {
                skip(rd)?;
            }
        }
    }
    Ok(Some(ev))
}

fn decode_map_event(rd: &mut &[u8], stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    // The type may come after the fields: each known key's first value is kept as bytes
    // and read once the type is known (a later duplicate is ignored, as a lookup would).
    let n = len_of(rd, true)?;
    let mut first: [Option<&[u8]>; MAP_KEYS.len()] = [None; MAP_KEYS.len()];
    let mut count = [0u64; MAP_KEYS.len()];
    let mut other_keys = 0u64;
    for _ in 0..n {
        match str_of(rd)?.and_then(|k| MAP_KEYS.iter().position(|m| *m == k)) {
            Some(k) => {
                count[k] += 1;
                let v = skip(rd)?;
                first[k].get_or_insert(v);
            }
            None => {
                other_keys += 1;
                skip(rd)?;
            }
        }
    }
    let field = |k: usize| first[k];
    let Some(tag) = field(K_TYPE).map(|mut v| str_of(&mut v)).transpose()?.flatten() else {
        return err("event: map without `type`");
    };
    let Some(&(_, known)) = MAP_KNOWN.iter().find(|(t, _)| *t == tag) else {
        stats.unknown_events += 1;
        return Ok(None);
    };
    stats.unknown_fields +=
        other_keys + (0..MAP_KEYS.len()).filter(|k| known & (1 << k) == 0).map(|k| count[k]).sum::<u64>();
    let hashes_field = || match field(K_HASHES) {
        Some(mut v) => hashes(&mut v, "block_hashes"),
        None => err("block_hashes: expected an array"),
    };
    let read = |k: usize, f: &dyn Fn(&mut &[u8]) -> Result<u32, DecodeError>| field(k).map_or(Ok(0), |mut v| f(&mut v));
    let medium = field(K_MEDIUM).map(|mut v| str_of(&mut v)).transpose()?.flatten().map(str::to_string);
    Ok(Some(match tag {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: hashes_field()?,
            parent_block_hash: field(K_PARENT).map(|mut v| opt_hash(&mut v)).transpose()?.flatten(),
            token_ids: field(K_TOKENS).map_or(Ok(Vec::new()), |mut v| tokens(&mut v))?,
            block_size: read(K_BLOCK_SIZE, &small)?,
            medium,
            group_idx: read(K_GROUP, &small)?,
        },
        "BlockRemoved" => {
            KvEvent::BlockRemoved { block_hashes: hashes_field()?, medium, group_idx: read(K_GROUP, &small)? }
        }
        _ => KvEvent::AllBlocksCleared,
    }))
}

fn decode_event(rd: &mut &[u8], stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    match peek(rd)? {
        m if is_array(m) => decode_array_event(rd, stats),
        m if is_map(m) => decode_map_event(rd, stats),
        _ => {
            skip(rd)?;
            err("event: expected an array or a map")
        }
    }
}

fn decode_events(rd: &mut &[u8], stats: &mut DecodeStats) -> Result<Vec<KvEvent>, DecodeError> {
    if !is_array(peek(rd)?) {
        skip(rd)?;
        return err("batch: `events` is not an array");
    }
    let n = len_of(rd, false)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        if let Some(ev) = decode_event(rd, stats)? {
            out.push(ev);
        }
    }
    Ok(out)
}

/// Decodes a msgpack payload (array or map batch, either event encoding).
///
/// The payload is read marker by marker (rmp), straight into the events: no intermediate
/// value tree (rmpv's cost 16 % of ingestion at 1,024 engines). It reads what an rmpv
/// `Value` walk reads: the first value of a repeated map key, fields not understood skipped
/// and counted; the test `decodes_as_a_value_walk_does` holds the two together.
///
/// # Errors
/// [`DecodeError`] for anything that is not a batch.
pub fn decode(payload: &[u8]) -> Result<(EventBatch, DecodeStats), DecodeError> {
    let mut rd = payload;
    let mut stats = DecodeStats::default();
    let (mut ts, mut events, mut rank) = (None, None, None);
    match peek(rd)? {
        m if is_array(m) => {
            let n = len_of(&mut rd, false)?;
            for i in 0..n {
                match i {
                    0 => ts = Some(num(&mut rd)?),
                    1 => events = Some(decode_events(&mut rd, &mut stats)?),
                    2 => rank = Some(num(&mut rd)?),
                    _ => {
                        skip(&mut rd)?;
                    }
                }
            }
        }
        m if is_map(m) => {
            let n = len_of(&mut rd, true)?;
            // `data_parallel_rank` wins over `attn_dp_rank` when both are there.
            let mut attn = None;
            for _ in 0..n {
                match str_of(&mut rd)? {
                    Some("ts") if ts.is_none() => ts = Some(num(&mut rd)?),
                    Some("events") if events.is_none() => events = Some(decode_events(&mut rd, &mut stats)?),
                    Some("data_parallel_rank") if rank.is_none() => rank = Some(num(&mut rd)?),
                    Some("attn_dp_rank") if attn.is_none() => attn = Some(num(&mut rd)?),
                    _ => {
                        skip(&mut rd)?;
                    }
                }
            }
            rank = rank.or(attn);
        }
        _ => {
            skip(&mut rd)?;
            return err("batch: expected an array or a map");
        }
    }
    let ts = match ts {
        Some(Num::U(x)) => x as f64,
        Some(Num::Neg(x)) => x as f64,
        Some(Num::F(x)) => x,
        _ => 0.0,
    };
    let Some(events) = events else { return err("batch: `events` is not an array") };
    let dp_rank = match rank {
        Some(Num::U(x)) => i64::try_from(x).ok(),
        Some(Num::Neg(x)) => Some(x),
        _ => None,
    };
    Ok((EventBatch { ts, events, dp_rank }, stats))
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

/// The decoder as it was, over an rmpv `Value` tree: the reference the marker-by-marker
/// [`decode`] is held to.
#[cfg(test)]
mod value_walk {
    use super::{DecodeError, DecodeStats, EventBatch, KvEvent};
    use rmpv::Value;

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
    pub(super) fn decode(payload: &[u8]) -> Result<(EventBatch, DecodeStats), DecodeError> {
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
}

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

    /// A legacy array batch built field by field from the spec, with a bytes hash, an
    /// extra trailing field, an unknown event type, a map event with a field not known and
    /// SGLang's rank in the third slot.
    fn spec_variants(digest: &[u8]) -> Value {
        Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::Binary(digest.to_vec())]),
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
        ])
    }

    #[test]
    fn spec_variants_bytes_hashes_unknowns_and_sglang_rank() {
        let digest: Vec<u8> = (1..=32).collect();
        let v = spec_variants(&digest);
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

    fn bytes_of(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode");
        out
    }

    /// A map batch whose rank is SGLang's, whose events put `type` last, repeat keys (the
    /// first counts), carry a key that is not a string and a medium that is not one.
    fn map_oddities() -> Value {
        let s = |x: &str| Value::from(x);
        let i = |x: i64| Value::from(x);
        Value::Map(vec![
            (s("attn_dp_rank"), i(2)),
            (
                s("events"),
                Value::Array(vec![
                    Value::Map(vec![
                        (s("block_hashes"), Value::Array(vec![i(-5), i(6)])),
                        (s("token_ids"), Value::Array((0..8).map(Value::from).collect())),
                        (s("block_hashes"), s("a second one, ignored")),
                        (i(7), i(1)),
                        (s("medium"), i(3)),
                        (s("block_size"), i(4)),
                        (s("type"), s("BlockStored")),
                    ]),
                    Value::Map(vec![(s("type"), s("AllBlocksCleared")), (s("token_ids"), i(1))]),
                ]),
            ),
            (s("ts"), i(-3)),
            (s("events"), s("a second one, ignored")),
        ])
    }

    #[test]
    fn decodes_as_a_value_walk_does() {
        let digest: Vec<u8> = (1..=32).collect();
        let seeds = [
            encode(&sample(), Encoding::Legacy),
            encode(&sample(), Encoding::Map),
            bytes_of(&spec_variants(&digest)),
            bytes_of(&map_oddities()),
        ];
        let same = |b: &[u8]| {
            let (a, r) = (decode(b), value_walk::decode(b));
            match (&a, &r) {
                // Debug strings: a NaN timestamp is the same NaN.
                (Ok(a), Ok(r)) => assert_eq!(format!("{a:?}"), format!("{r:?}"), "{b:?}"),
                (Err(_), Err(_)) => {}
                _ => panic!("{b:?}: marker by marker {a:?}, value walk {r:?}"),
            }
            a.is_ok()
        };
        for seed in &seeds {
            assert!(same(seed), "a seed decodes");
        }
        assert_eq!(decode(&seeds[3]).expect("decodes").1, DecodeStats { unknown_events: 0, unknown_fields: 2 });
        // A count the payload cannot hold, in the last field of the last event of the
        // batch: an error, not the items that are there.
        let v = Value::Array(vec![
            Value::from(1),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(1)]),
                Value::Nil,
                Value::Array((0..20).map(Value::from).collect()),
            ])]),
        ]);
        let mut cut = bytes_of(&v);
        cut.truncate(cut.len() - 5);
        assert!(decode(&cut).is_err() && value_walk::decode(&cut).is_err());
        // Deterministic mutations of each seed: a byte changed (often to a marker), cut,
        // inserted or removed; the two decoders agree on every one.
        let markers = [0x90, 0x80, 0xc0, 0xc4, 0xcc, 0xcf, 0xd0, 0xd3, 0xca, 0xcb, 0xa0, 0xdc, 0xde, 0xc1, 0xff];
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            x >> 33
        };
        let mut decoded = 0;
        for seed in &seeds {
            for _ in 0..4000 {
                let mut b = seed.clone();
                for _ in 0..=next() % 3 {
                    let at = next() as usize % b.len().max(1);
                    match next() % 5 {
                        0 => b.truncate(at),
                        1 if at < b.len() => b[at] = markers[next() as usize % markers.len()],
                        2 => b.insert(at.min(b.len()), next() as u8),
                        3 if at < b.len() => {
                            b.remove(at);
                        }
                        _ if at < b.len() => b[at] = next() as u8,
                        _ => {}
                    }
                }
                decoded += usize::from(same(&b));
            }
        }
        // Not only errors were compared.
        assert!(decoded > 1000, "{decoded} mutations decoded");
    }
}
