//! Request traces: readers with file/line/field errors, and transforms.
//!
//! Formats:
//! - **Mooncake JSONL** (Qin et al., FAST'25): one object per line with `timestamp` (ms
//!   from trace start), `input_length`, `output_length` (tokens) and `hash_ids` (one
//!   prefix-chained id per 512-token block). Mooncake has no session ids; the depth-2
//!   prefix group (first two block ids) stands in as the session, as the trace README
//!   suggests.
//! - **Azure CSV** (Patel et al., ISCA'24): `TIMESTAMP,ContextTokens,GeneratedTokens`;
//!   lengths only, no prefix information.
//! - **Session JSONL**: `session_id`, `turn_id`, `timestamp` (ms), `input_length`,
//!   `output_length`, `hash_ids` (optional `block_size`, default 512).
//!
//! Transforms: [`scale_rate`], [`spread_seconds`], [`sample`], [`session_slice`], [`cap_sessions`] (B3 `cache_aware_proxy.py`'s
//! capped transform), [`truncate`].

use kvroute_core::trace::{TurnKey, cap_turns};
use kvroute_core::types::{BlockHash, Nanos};
use rand_core::{Rng, SeedableRng};
use serde::Deserialize;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival time from the trace start.
    pub arrival: Nanos,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens (at least 1).
    pub output_tokens: u32,
    /// Prefix-chained block ids (empty when the trace has no prefix information).
    pub blocks: Vec<BlockHash>,
    /// Tokens per block of `blocks`.
    pub block_tokens: u32,
    /// Session id, when known.
    pub session: Option<String>,
    /// Turn number within the session.
    pub turn: u64,
    /// The request's cache scope (its tenant), when the trace says (`tenant`, a string or
    /// number; `kvroute serve --record` writes it under tenant isolation).
    pub tenant: Option<String>,
}

/// A malformed trace: names the file, the 1-based line and the field.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("{file}: cannot read: {cause}")]
    Io {
        /// File.
        file: PathBuf,
        /// Cause, in the message. Not also the error's `source()`: a chain printer (anyhow's
        /// `{:#}`) then printed it twice (`… os error 2): No such file … (os error 2)`).
        cause: std::io::Error,
    },
    /// A line or field is malformed.
    #[error("{file}:{line}: field `{field}`: {message}")]
    Field {
        /// File.
        file: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Field name (or `line` for the whole line).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The trace has no requests.
    #[error("{file}: the trace has no requests")]
    Empty {
        /// File.
        file: PathBuf,
    },
    /// No trace was given and the vendored Mooncake trace is missing (a partial checkout).
    #[error(
        "cannot find the Mooncake trace (data/traces/mooncake_conversation_trace.jsonl in the repository); \
         pass --trace PATH"
    )]
    NotFound,
}

/// The Mooncake conversation trace vendored in this repository (`data/traces/`, with its
/// source, licence and checksum), as built: an absolute path into the source checkout.
pub const VENDORED_MOONCAKE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");

/// The Mooncake conversation trace: `given`, else the copy vendored in the repository
/// ([`VENDORED_MOONCAKE`]), else `data/traces/` under the current directory (a binary built
/// elsewhere, run from the repository root). Nothing outside the repository is searched.
///
/// # Errors
/// [`TraceError::NotFound`] when nothing is given and no copy is found.
pub fn find_default(given: Option<&Path>) -> Result<PathBuf, TraceError> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    [VENDORED_MOONCAKE, "data/traces/mooncake_conversation_trace.jsonl"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or(TraceError::NotFound)
}

/// Trace formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Mooncake JSONL.
    Mooncake,
    /// Azure LLM inference CSV.
    Azure,
    /// Session JSONL.
    Session,
}

impl TraceFormat {
    /// Guesses the format from the file: `.csv` is Azure; JSONL with `session_id` on its
    /// first non-blank line is Session (the readers skip blank lines, so must this); other
    /// JSONL is Mooncake.
    ///
    /// # Errors
    /// [`TraceError::Io`] when the file cannot be opened or read.
    pub fn detect(path: &Path) -> Result<TraceFormat, TraceError> {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) {
            return Ok(TraceFormat::Azure);
        }
        let io = |cause| TraceError::Io { file: path.into(), cause };
        let mut reader = std::io::BufReader::new(std::fs::File::open(path).map_err(io)?);
        let mut first = String::new();
        while reader.read_line(&mut first).map_err(io)? > 0 && first.trim().is_empty() {
            first.clear();
        }
        Ok(if first.contains("\"session_id\"") { TraceFormat::Session } else { TraceFormat::Mooncake })
    }
}

/// Keys each tenant's requests apart, as a router with tenant isolation does (and an
/// engine honouring vLLM's `cache_salt`): the blocks and session of every request with a
/// `tenant` are salted with [`kvroute_core::tenant::TenantSalt`] of its tenant, so no two
/// tenants share a cached block. Returns how many requests were salted. Replaying a trace
/// with and without this shows the hit that isolation costs.
pub fn isolate_tenants(trace: &mut [TraceRequest]) -> usize {
    let mut n = 0;
    for r in trace.iter_mut() {
        let Some(t) = &r.tenant else { continue };
        let salt = kvroute_core::tenant::TenantSalt::of(&format!("tenant:{t}"));
        r.blocks = salt.salt_blocks(&r.blocks);
        r.session = r.session.as_deref().map(|s| salt.salt_session(s));
        n += 1;
    }
    n
}

/// Reads a trace of `format` (or detected when `None`), sorted by arrival (stable).
///
/// # Errors
/// [`TraceError`] naming the file, line and field of the first problem.
///
/// A detected Mooncake trace (no `session_id` on its first line) with a `session_id` on a
/// later line is refused, naming that line: it is a session trace missing an id, and read
/// as Mooncake its sessions would be dropped without a word. `format`
/// `Some(Mooncake)` (`kvroute replay --format mooncake`) reads such a file, ignoring the ids.
pub fn read(path: &Path, format: Option<TraceFormat>) -> Result<Vec<TraceRequest>, TraceError> {
    let open = || std::fs::File::open(path).map_err(|cause| TraceError::Io { file: path.into(), cause });
    match format {
        Some(f) => read_from(std::io::BufReader::new(open()?), path, f),
        None => match TraceFormat::detect(path)? {
            TraceFormat::Mooncake => {
                let (out, session_line) = read_jsonl(std::io::BufReader::new(open()?), path, false)?;
                if let Some(n) = session_line {
                    let msg = "a session id in a trace read as Mooncake (its first line has none): give every \
                               line a session_id (`kvroute replay --format mooncake` reads it, ignoring them)";
                    return Err(field_err(path, n, "session_id", msg));
                }
                finish(out, path)
            }
            f => read_from(std::io::BufReader::new(open()?), path, f),
        },
    }
}

/// Reads a trace of `format` from `reader` (`name` is the file errors name), sorted by
/// arrival (stable).
///
/// # Errors
/// [`TraceError`] naming `name`, the line and the field of the first problem; an empty
/// trace is an error.
pub fn read_from(reader: impl BufRead, name: &Path, format: TraceFormat) -> Result<Vec<TraceRequest>, TraceError> {
    let out = match format {
        TraceFormat::Mooncake => read_jsonl(reader, name, false)?.0,
        TraceFormat::Session => read_jsonl(reader, name, true)?.0,
        TraceFormat::Azure => read_azure(reader, name)?,
    };
    finish(out, name)
}

/// A read trace sorted by arrival (stable); refused when empty.
fn finish(mut out: Vec<TraceRequest>, name: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    if out.is_empty() {
        return Err(TraceError::Empty { file: name.into() });
    }
    out.sort_by_key(|r| r.arrival);
    Ok(out)
}

#[derive(Deserialize)]
struct JsonLine {
    timestamp: Option<serde_json::Value>,
    input_length: Option<serde_json::Value>,
    output_length: Option<serde_json::Value>,
    hash_ids: Option<serde_json::Value>,
    session_id: Option<serde_json::Value>,
    turn_id: Option<serde_json::Value>,
    block_size: Option<serde_json::Value>,
    tenant: Option<serde_json::Value>,
}

fn field_err(path: &Path, line: usize, field: &str, message: impl Into<String>) -> TraceError {
    TraceError::Field { file: path.into(), line, field: field.into(), message: message.into() }
}

fn uint(path: &Path, line: usize, field: &str, v: Option<&serde_json::Value>, max: u64) -> Result<u64, TraceError> {
    let v = v.ok_or_else(|| field_err(path, line, field, "missing"))?;
    let n =
        v.as_u64().ok_or_else(|| field_err(path, line, field, format!("expected a non-negative integer, got {v}")))?;
    if n > max {
        return Err(field_err(path, line, field, format!("{n} is larger than the maximum {max}")));
    }
    Ok(n)
}

/// Largest prompt or output length accepted (tokens).
pub const MAX_TOKENS: u64 = 10_000_000;

/// Latest arrival a trace may hold, seconds from its start (10^7 s, about 116 days; the
/// public traces span an hour to a week). Readers refuse a later timestamp and
/// [`check_rate_scale`] a factor that stretches a trace past it, so the simulated clock
/// (u64 nanoseconds, ~585 years) never saturates.
pub const MAX_ARRIVAL_SECS: f64 = 1e7;

/// Smallest and largest rate scale factor [`check_rate_scale`] accepts (a million times
/// slower or faster).
pub const RATE_SCALE_RANGE: (f64, f64) = (1e-6, 1e6);

/// Reads Mooncake JSONL, or session JSONL (`sessions`: `session_id` on each line,
/// `turn_id` and `hash_ids` optional); blank lines are skipped. Mooncake's turns are numbered
/// within each depth-2 prefix group. Also returns, when read as Mooncake, the first line
/// that carries a `session_id` anyway.
fn read_jsonl(
    reader: impl BufRead,
    path: &Path,
    sessions: bool,
) -> Result<(Vec<TraceRequest>, Option<usize>), TraceError> {
    let mut out = Vec::new();
    let mut session_line = None;
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| field_err(path, n, "line", format!("not valid UTF-8 text: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let j: JsonLine =
            serde_json::from_str(&line).map_err(|e| field_err(path, n, "line", format!("not a JSON object: {e}")))?;
        if !sessions && session_line.is_none() && j.session_id.is_some() {
            session_line = Some(n);
        }
        out.push(json_request(&j, path, n, sessions)?);
    }
    if !sessions {
        number_mooncake_turns(&mut out);
    }
    Ok((out, session_line))
}

/// The request of JSON line `n`, each field checked and named in its error.
fn json_request(j: &JsonLine, path: &Path, n: usize, sessions: bool) -> Result<TraceRequest, TraceError> {
    let ts = j.timestamp.as_ref().ok_or_else(|| field_err(path, n, "timestamp", "missing"))?;
    let ts_ms = ts
        .as_f64()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| field_err(path, n, "timestamp", format!("expected milliseconds >= 0, got {ts}")))?;
    let max_ms = MAX_ARRIVAL_SECS * 1e3;
    if ts_ms > max_ms {
        let msg = format!("{ts} ms is later than the maximum {max_ms} ms (10^7 s from the trace start)");
        return Err(field_err(path, n, "timestamp", msg));
    }
    let input = uint(path, n, "input_length", j.input_length.as_ref(), MAX_TOKENS)?;
    let output = uint(path, n, "output_length", j.output_length.as_ref(), MAX_TOKENS)?;
    let blocks = match &j.hash_ids {
        None if sessions => Vec::new(),
        None => return Err(field_err(path, n, "hash_ids", "missing")),
        Some(v) => hash_ids(v, path, n)?,
    };
    let block_tokens = match &j.block_size {
        None => 512,
        Some(v) => uint(path, n, "block_size", Some(v), 1 << 20)? as u32,
    };
    if block_tokens == 0 {
        return Err(field_err(path, n, "block_size", "must be at least 1"));
    }
    let (session, turn) = if sessions {
        json_session(j, path, n)?
    } else {
        // Mooncake: the depth-2 prefix group stands in for the session.
        (blocks.get(1).map(|b| format!("{}-{}", blocks[0].0, b.0)), 0)
    };
    let tenant = match &j.tenant {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(t)) => Some(t.clone()),
        Some(serde_json::Value::Number(x)) => Some(x.to_string()),
        Some(other) => {
            return Err(field_err(path, n, "tenant", format!("expected a string or number, got {other}")));
        }
    };
    Ok(TraceRequest {
        tenant,
        // Rounded to the nanosecond: milliseconds / 1000 as seconds lost 1 ns on some
        // stamps (4264637 ms read back as 4264636999999 ns).
        arrival: Nanos((ts_ms * 1e6).round() as u64),
        input_tokens: input.max(1) as u32,
        output_tokens: output.max(1) as u32,
        blocks,
        block_tokens,
        session,
        turn,
    })
}

/// `hash_ids`: an array of non-negative integers.
fn hash_ids(v: &serde_json::Value, path: &Path, n: usize) -> Result<Vec<BlockHash>, TraceError> {
    let arr = v.as_array().ok_or_else(|| field_err(path, n, "hash_ids", "expected an array of integers"))?;
    let mut b = Vec::with_capacity(arr.len());
    for (k, x) in arr.iter().enumerate() {
        let id = x
            .as_u64()
            .ok_or_else(|| field_err(path, n, "hash_ids", format!("element {k} is not a non-negative integer: {x}")))?;
        b.push(BlockHash(id));
    }
    Ok(b)
}

/// A session line's `session_id` (string or number) and `turn_id` (0 when absent).
fn json_session(j: &JsonLine, path: &Path, n: usize) -> Result<(Option<String>, u64), TraceError> {
    let s = j.session_id.as_ref().ok_or_else(|| field_err(path, n, "session_id", "missing"))?;
    let s = match s {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(x) => x.to_string(),
        other => {
            return Err(field_err(path, n, "session_id", format!("expected a string or number, got {other}")));
        }
    };
    let turn = match &j.turn_id {
        None => 0,
        Some(v) => uint(path, n, "turn_id", Some(v), u64::MAX)?,
    };
    Ok((Some(s), turn))
}

/// Mooncake: turn numbers within each depth-2 group, in arrival order.
fn number_mooncake_turns(out: &mut [TraceRequest]) {
    let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for r in out {
        if let Some(s) = &r.session {
            let t = seen.entry(s.clone()).or_insert(0);
            r.turn = *t;
            *t += 1;
        }
    }
}

/// Reads Azure CSV. Arrivals are measured from the earliest `TIMESTAMP` in the file, not the
/// first row's, so rows out of time order give the same trace as the file sorted (as the
/// JSONL readers sort by absolute time).
fn read_azure(reader: impl std::io::Read, path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).from_reader(reader);
    let headers = rdr.headers().map_err(|e| field_err(path, 1, "header", e.to_string()))?.clone();
    let col = |name: &str| -> Result<usize, TraceError> {
        headers.iter().position(|h| h.trim() == name).ok_or_else(|| field_err(path, 1, name, "missing column"))
    };
    let (c_ts, c_in, c_out) = (col("TIMESTAMP")?, col("ContextTokens")?, col("GeneratedTokens")?);
    // (line, seconds since 1970, input, output) of each row.
    let mut rows: Vec<(usize, f64, u64, u64)> = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        let n = i + 2;
        let rec = rec.map_err(|e| field_err(path, n, "line", e.to_string()))?;
        let get = |c: usize, name: &str| rec.get(c).ok_or_else(|| field_err(path, n, name, "missing"));
        let ts = parse_datetime(get(c_ts, "TIMESTAMP")?)
            .ok_or_else(|| field_err(path, n, "TIMESTAMP", "expected `YYYY-MM-DD HH:MM:SS[.fraction]`"))?;
        let num = |c: usize, name: &str| -> Result<u64, TraceError> {
            let s = get(c, name)?;
            let v: u64 = s
                .trim()
                .parse()
                .map_err(|_| field_err(path, n, name, format!("expected a non-negative integer, got `{s}`")))?;
            if v > MAX_TOKENS {
                return Err(field_err(path, n, name, format!("{v} is larger than the maximum {MAX_TOKENS}")));
            }
            Ok(v)
        };
        let input = num(c_in, "ContextTokens")?;
        let output = num(c_out, "GeneratedTokens")?;
        rows.push((n, ts, input, output));
    }
    let Some(&(first_line, base, _, _)) = rows.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(rows.len());
    for (n, ts, input, output) in rows {
        if ts - base > MAX_ARRIVAL_SECS {
            let msg =
                format!("{} s after the earliest row (line {first_line}), more than the maximum 10^7 s", ts - base);
            return Err(field_err(path, n, "TIMESTAMP", msg));
        }
        out.push(TraceRequest {
            tenant: None,
            arrival: Nanos::from_secs_f64(ts - base),
            input_tokens: input.max(1) as u32,
            output_tokens: output.max(1) as u32,
            blocks: Vec::new(),
            block_tokens: 512,
            session: None,
            turn: 0,
        });
    }
    Ok(out)
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, proleptic Gregorian).
fn parse_datetime(s: &str) -> Option<f64> {
    let s = s.trim();
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let (y, m, day): (i64, i64, i64) = (d.next()?.parse().ok()?, d.next()?.parse().ok()?, d.next()?.parse().ok()?);
    let mut t = time.split(':');
    let (hh, mm): (i64, i64) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    let ss: f64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || !(0.0..61.0).contains(&ss) {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

/// Checks a rate scale factor for [`scale_rate`] on `trace`: finite, within
/// [`RATE_SCALE_RANGE`], and not stretching the last arrival past [`MAX_ARRIVAL_SECS`].
///
/// # Errors
/// What is wrong, for the caller to prefix with its flag's name.
pub fn check_rate_scale(trace: &[TraceRequest], factor: f64) -> Result<(), String> {
    let (lo, hi) = RATE_SCALE_RANGE;
    if !(factor.is_finite() && (lo..=hi).contains(&factor)) {
        return Err(format!("{factor:e} must be between {lo:e} and {hi:e}"));
    }
    let last = trace.iter().map(|r| r.arrival).max().unwrap_or_default().as_secs_f64();
    if last / factor > MAX_ARRIVAL_SECS {
        return Err(format!(
            "{factor} stretches the trace's {last:.1} s to {:.3e} s, more than the maximum 10^7 s",
            last / factor
        ));
    }
    Ok(())
}

/// Divides every arrival time by `factor` (2.0 = twice the request rate); check it with
/// [`check_rate_scale`] first (an arrival past the clock's end saturates).
pub fn scale_rate(trace: &mut [TraceRequest], factor: f64) {
    if factor > 0.0 && factor.is_finite() {
        for r in trace {
            r.arrival = Nanos((r.arrival.0 as f64 / factor) as u64);
        }
    }
}

/// Spreads requests sharing a timestamp quantised to whole seconds evenly over that second
/// (the k-th of n at `s + k/n`), keeping their order. The Mooncake trace has 1,180
/// distinct timestamps for 12,031 requests; without this each second is a burst.
pub fn spread_seconds(trace: &mut [TraceRequest]) {
    spread_with(trace, |n, offsets| offsets.extend((0..n).map(|k| 1_000_000_000 * k / n)));
}

/// Like [`spread_seconds`], but the n requests sharing a whole second arrive at n uniform
/// random instants of that second (drawn from `seed`, sorted so the trace order is kept).
/// Each seed is another realisation of the same trace at the same load: the evenly spread
/// arrivals are one arbitrary choice among them, and results near saturation depend on it.
pub fn spread_seconds_random(trace: &mut [TraceRequest], seed: u64) {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    spread_with(trace, |n, offsets| {
        offsets.extend((0..n).map(|_| rng.next_u64() % 1_000_000_000));
        offsets.sort_unstable();
    });
}

/// Groups requests sharing a whole-second timestamp and moves the k-th of each group of n
/// to `second + offsets[k]` nanoseconds, with `offsets` filled by `fill(n, offsets)`.
fn spread_with(trace: &mut [TraceRequest], mut fill: impl FnMut(u64, &mut Vec<u64>)) {
    let mut offsets = Vec::new();
    let mut i = 0;
    while i < trace.len() {
        let t = trace[i].arrival;
        let mut j = i;
        while j < trace.len() && trace[j].arrival == t {
            j += 1;
        }
        let n = (j - i) as u64;
        if t.0.is_multiple_of(1_000_000_000) && n > 1 {
            offsets.clear();
            fill(n, &mut offsets);
            for (r, off) in trace[i..j].iter_mut().zip(&offsets) {
                r.arrival = Nanos(t.0 + off);
            }
        }
        i = j;
    }
}

/// Keeps each request with probability `fraction`, deterministically from `seed`.
pub fn sample(trace: Vec<TraceRequest>, fraction: f64, seed: u64) -> Vec<TraceRequest> {
    if fraction >= 1.0 {
        return trace;
    }
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let threshold = (fraction.max(0.0) * u64::MAX as f64) as u64;
    trace.into_iter().filter(|_| rng.next_u64() <= threshold).collect()
}

/// B3 `cache_aware_proxy.py`'s capped transform: each session's first `max_turns` turns, in time order
/// (requests without a session are kept).
pub fn cap_sessions(trace: Vec<TraceRequest>, max_turns: usize) -> Vec<TraceRequest> {
    cap_turns(trace, max_turns, |r| TurnKey {
        session: r.session.as_deref().map_or(u64::MAX, |s| kvroute_core::hash::stable_hash(s.as_bytes())),
        turn: if r.session.is_some() { r.turn } else { r.arrival.0 },
        timestamp: r.arrival.0,
    })
}

/// Scales a trace down to a smaller model: every block becomes `block_tokens` tokens and
/// each prompt shrinks by the same factor (at least 1 token), so requests keep their
/// shared prefixes and relative lengths. Requests without blocks shrink by the factor of
/// the trace's first block size (512 for Mooncake when none has blocks).
pub fn rescale_blocks(trace: &mut [TraceRequest], block_tokens: u32) {
    let bt = block_tokens.max(1);
    let default_from = trace.iter().find(|r| !r.blocks.is_empty()).map_or(512, |r| r.block_tokens.max(1));
    for r in trace {
        let from = if r.blocks.is_empty() { default_from } else { r.block_tokens.max(1) };
        r.input_tokens = ((u64::from(r.input_tokens) * u64::from(bt)).div_ceil(u64::from(from))).max(1) as u32;
        r.block_tokens = bt;
    }
}

/// A slice of a trace chosen for its sessions: the requests arriving in `[start, start +
/// window)` (seconds from the trace start; no window = to the end), then only the sessions
/// with at least `min_turns` requests in that span whose prompts are all at most
/// `max_input_tokens` long. Requests without a session count as one-request sessions.
/// Used to cut a trace down to a size a CPU engine serves in minutes while keeping its
/// real arrival times and prefix reuse (the Mooncake slice of docs/lab/2026-11-23-llama-cpp-runs.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SessionSlice {
    /// Start of the span, seconds from the trace start.
    pub start_secs: f64,
    /// Length of the span, seconds (`None`: to the end).
    pub window_secs: Option<f64>,
    /// Keep sessions with at least this many requests in the span.
    pub min_turns: usize,
    /// Drop a session if one of its prompts is longer than this (tokens, before any
    /// block rescaling).
    pub max_input_tokens: Option<u32>,
}

/// Applies a [`SessionSlice`], keeping the order of the requests.
pub fn session_slice(trace: Vec<TraceRequest>, slice: &SessionSlice) -> Vec<TraceRequest> {
    let from = Nanos((slice.start_secs.max(0.0) * 1e9) as u64);
    let to = slice.window_secs.map(|w| Nanos(from.0.saturating_add((w.max(0.0) * 1e9) as u64)));
    let span: Vec<TraceRequest> =
        trace.into_iter().filter(|r| r.arrival >= from && to.is_none_or(|t| r.arrival < t)).collect();
    let mut sessions: std::collections::HashMap<&str, (usize, u32)> = std::collections::HashMap::new();
    for r in &span {
        if let Some(s) = &r.session {
            let e = sessions.entry(s.as_str()).or_insert((0, 0));
            e.0 += 1;
            e.1 = e.1.max(r.input_tokens);
        }
    }
    let keep = |r: &TraceRequest| {
        let (turns, longest) =
            r.session.as_deref().and_then(|s| sessions.get(s).copied()).unwrap_or((1, r.input_tokens));
        turns >= slice.min_turns && slice.max_input_tokens.is_none_or(|m| longest <= m)
    };
    let kept: Vec<bool> = span.iter().map(keep).collect();
    drop(sessions); // it borrows the session ids of `span`, which is consumed next
    span.into_iter().zip(kept).filter_map(|(r, k)| k.then_some(r)).collect()
}

/// Moves every arrival back by the first one's, so the trace starts at time 0 (a slice cut
/// from the middle of a trace, replayed as it would be sent).
pub fn rebase(trace: &mut [TraceRequest]) {
    if let Some(first) = trace.first().map(|r| r.arrival) {
        for r in trace {
            r.arrival.0 = r.arrival.0.saturating_sub(first.0);
        }
    }
}

/// Keeps the first `n` requests.
pub fn truncate(trace: &mut Vec<TraceRequest>, n: usize) {
    trace.truncate(n);
}

/// The infinite-cache upper bound of a trace: the fraction of prompt tokens that one shared,
/// never-evicting cache would serve (the longest leading run of each request's blocks seen
/// in any earlier request, full blocks only). Returns `(hit_tokens, input_tokens)`.
pub fn infinite_cache_hit(trace: &[TraceRequest]) -> (u64, u64) {
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in trace {
        let run = r.blocks.iter().take_while(|b| seen.contains(*b)).count() as u64;
        hit += (run * r.block_tokens as u64).min(r.input_tokens as u64);
        total += r.input_tokens as u64;
        seen.extend(r.blocks.iter().copied());
    }
    (hit, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file written for one test in a fresh directory of its own, removed with the directory
    /// when dropped (also on a panic).
    struct Tmp {
        path: PathBuf,
        _dir: tempfile::TempDir,
    }

    impl std::ops::Deref for Tmp {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.path
        }
    }

    fn tmp(name: &str, body: &str) -> Tmp {
        let dir = tempfile::Builder::new().prefix("kvroute-trace-test-").tempdir().expect("temp dir");
        let path = dir.path().join(name);
        std::fs::File::create(&path).and_then(|mut f| f.write_all(body.as_bytes())).expect("write");
        Tmp { path, _dir: dir }
    }

    #[test]
    fn mooncake_lines_parse_and_sessions_stand_in() {
        let p = tmp(
            "ok.jsonl",
            "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n{\"timestamp\": 1000, \"input_length\": 1200, \"output_length\": 7, \"hash_ids\": [0, 1, 2]}\n",
        );
        let t = read(&p, None).expect("reads");
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].arrival, Nanos::from_secs(1));
        assert_eq!(t[1].session.as_deref(), Some("0-1"));
        assert_eq!((t[0].turn, t[1].turn), (0, 1));
        assert_eq!(infinite_cache_hit(&t), (1024, 1900));
    }

    #[test]
    fn session_slice_keeps_long_enough_sessions_in_the_span() {
        let req = |secs: u64, session: Option<&str>, input: u32| TraceRequest {
            tenant: None,
            arrival: Nanos::from_secs(secs),
            input_tokens: input,
            output_tokens: 1,
            blocks: Vec::new(),
            block_tokens: 512,
            session: session.map(str::to_owned),
            turn: 0,
        };
        let t = vec![
            req(0, Some("a"), 10),  // before the span
            req(10, Some("a"), 10), // a: 2 turns in the span
            req(11, Some("b"), 10), // b: 3 turns, one too long
            req(12, None, 10),      // no session: 1 turn
            req(13, Some("a"), 10),
            req(14, Some("b"), 900),
            req(15, Some("c"), 10), // c: 2 turns, the second after the span
            req(16, Some("b"), 10),
            req(40, Some("c"), 10),
        ];
        let slice = |min_turns, max_input_tokens| SessionSlice {
            start_secs: 10.0,
            window_secs: Some(20.0),
            min_turns,
            max_input_tokens,
        };
        let secs = |v: Vec<TraceRequest>| v.iter().map(|r| r.arrival.0 / 1_000_000_000).collect::<Vec<_>>();
        assert_eq!(secs(session_slice(t.clone(), &slice(2, None))), vec![10, 11, 13, 14, 16]);
        assert_eq!(secs(session_slice(t.clone(), &slice(2, Some(100)))), vec![10, 13]);
        assert_eq!(secs(session_slice(t.clone(), &slice(1, Some(100)))), vec![10, 12, 13, 15]);
        let all = SessionSlice { start_secs: 0.0, window_secs: None, min_turns: 0, max_input_tokens: None };
        assert_eq!(session_slice(t.clone(), &all), t);
    }

    #[test]
    fn malformed_lines_name_file_line_and_field() {
        let cases = [
            ("{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 5, \"hash_ids\": []}", "input_length"),
            ("{\"timestamp\": 0, \"output_length\": 5, \"hash_ids\": []}", "input_length"),
            ("{\"timestamp\": \"x\", \"input_length\": 3, \"output_length\": 5, \"hash_ids\": []}", "timestamp"),
            ("{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 5, \"hash_ids\": [1, \"a\"]}", "hash_ids"),
            ("{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 5}", "hash_ids"),
            ("not json", "line"),
        ];
        for (i, (line, field)) in cases.iter().enumerate() {
            let ok = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}";
            let p = tmp(&format!("bad{i}.jsonl"), &format!("{ok}\n{line}\n"));
            let e = read(&p, Some(TraceFormat::Mooncake)).expect_err("malformed").to_string();
            assert!(e.contains(&format!("bad{i}.jsonl:2: field `{field}`")), "{e}");
        }
        let p = tmp("empty.jsonl", "\n");
        assert!(matches!(read(&p, None), Err(TraceError::Empty { .. })));
        assert!(matches!(read(Path::new("/nonexistent/x.jsonl"), None), Err(TraceError::Io { .. })));
    }

    #[test]
    fn arrivals_past_the_limit_are_refused_naming_line_and_field() {
        // 2e13 ms saturated the u64 ns clock and hung the replay.
        let ok = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}";
        for ts in ["2e13", "10000000001", "1e300"] {
            let line =
                format!("{{\"timestamp\": {ts}, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}}");
            let p = tmp("late.jsonl", &format!("{ok}\n{line}\n"));
            let e = read(&p, None).expect_err("too late").to_string();
            assert!(e.contains("late.jsonl:2: field `timestamp`") && e.contains("maximum"), "{e}");
        }
        let line = "{\"timestamp\": 10000000000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}";
        let p = tmp("latest.jsonl", &format!("{ok}\n{line}\n"));
        let t = read(&p, None).expect("10^7 s is accepted");
        assert_eq!(t[1].arrival, Nanos::from_secs(10_000_000));
        let p = tmp(
            "span.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00,100,10\n9999-12-31 23:59:59,100,10\n",
        );
        let e = read(&p, None).expect_err("millennia").to_string();
        assert!(e.contains("span.csv:3: field `TIMESTAMP`"), "{e}");
    }

    #[test]
    fn rate_scales_that_overflow_the_clock_are_refused() {
        let at = |secs: u64| TraceRequest {
            tenant: None,
            arrival: Nanos::from_secs(secs),
            input_tokens: 10,
            output_tokens: 1,
            blocks: Vec::new(),
            block_tokens: 512,
            session: None,
            turn: 0,
        };
        let t = vec![at(0), at(3600)];
        for f in [1e-300, 0.0, -1.0, f64::NAN, f64::INFINITY, 1e300, 1e-7] {
            assert!(check_rate_scale(&t, f).is_err(), "{f}");
        }
        // 3600 s at 1e-4 is 3.6e7 s: past the limit although the factor is in range.
        let e = check_rate_scale(&t, 1e-4).expect_err("stretched");
        assert!(e.contains("3600.0 s") && e.contains("10^7 s"), "{e}");
        for f in [1e-3, 1.0, 1e6] {
            assert!(check_rate_scale(&t, f).is_ok(), "{f}");
        }
    }

    #[test]
    fn azure_csv_and_its_errors() {
        let p = tmp(
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:50.5,396,109\n",
        );
        let t = read(&p, None).expect("reads");
        assert_eq!(t[1].arrival, Nanos::from_secs(4));
        assert_eq!((t[1].input_tokens, t[1].output_tokens), (396, 109));
        let p = tmp("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12x,44\n");
        let e = read(&p, None).expect_err("bad").to_string();
        assert!(e.contains("b.csv:2: field `ContextTokens`"), "{e}");
        let p = tmp("c.csv", "TIME,ContextTokens,GeneratedTokens\n");
        assert!(read(&p, None).expect_err("bad header").to_string().contains("TIMESTAMP"));
    }

    #[test]
    fn azure_rows_out_of_time_order_read_as_the_sorted_file() {
        // Rows before the first one all became arrival 0: a 4 s trace read as a 1 s burst.
        let head = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
        let (a, b, c) =
            ("2023-11-16 18:15:50.5,100,10\n", "2023-11-16 18:15:46.5,200,20\n", "2023-11-16 18:15:48.5,300,30\n");
        let unsorted = read(&tmp("unsorted.csv", &format!("{head}{a}{b}{c}")), None).expect("reads");
        let sorted = read(&tmp("sorted.csv", &format!("{head}{b}{c}{a}")), None).expect("reads");
        assert_eq!(unsorted, sorted);
        let secs: Vec<f64> = sorted.iter().map(|r| r.arrival.as_secs_f64()).collect();
        assert_eq!(secs, vec![0.0, 2.0, 4.0]);
        // The span is measured from the earliest row wherever it is.
        let p = tmp("span-rev.csv", &format!("{head}9999-12-31 23:59:59,100,10\n0001-01-01 00:00:00,100,10\n"));
        let e = read(&p, None).expect_err("millennia").to_string();
        assert!(e.contains("span-rev.csv:2: field `TIMESTAMP`") && e.contains("earliest row (line 3)"), "{e}");
    }

    #[test]
    fn a_session_trace_with_blank_lines_first_is_detected_as_sessions() {
        // Detection read only line 1: a blank one made this a Mooncake trace, its session ids ignored.
        let line = |turn: u32, ts: u32| {
            format!(
                "{{\"session_id\": \"a\", \"turn_id\": {turn}, \"timestamp\": {ts}, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [{turn}]}}\n"
            )
        };
        for blank in ["\n", "\n  \r\n\n"] {
            let p = tmp("blank-first.jsonl", &format!("{blank}{}{}", line(0, 0), line(1, 100)));
            assert_eq!(TraceFormat::detect(&p).expect("reads"), TraceFormat::Session, "{blank:?}");
            let t = read(&p, None).expect("reads");
            assert_eq!((t[0].session.as_deref(), t[1].turn), (Some("a"), 1));
        }
        let p = tmp("all-blank.jsonl", "\n\n");
        assert_eq!(TraceFormat::detect(&p).expect("reads"), TraceFormat::Mooncake);
        // A first line without a session id, later ones with: refused naming the line, where
        // it was read as Mooncake and the sessions dropped; `--format mooncake` reads it.
        let mooncake = "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [1]}\n";
        let p = tmp("first-without.jsonl", &format!("{mooncake}{}", line(1, 100)));
        let e = read(&p, None).expect_err("refused").to_string();
        assert!(e.contains("first-without.jsonl:2: field `session_id`"), "{e}");
        assert_eq!(read(&p, Some(TraceFormat::Mooncake)).expect("forced").len(), 2);
    }

    #[test]
    fn an_unreadable_file_names_its_cause_once() {
        // The cause was both in the message and the error's source: printed twice.
        let chain = |e: &TraceError| {
            let mut text = e.to_string();
            let mut next = std::error::Error::source(e);
            while let Some(c) = next {
                text.push_str(&format!(": {c}"));
                next = c.source();
            }
            text
        };
        let e = read(Path::new("/nonexistent/x.jsonl"), None).expect_err("missing");
        assert_eq!(chain(&e).matches("os error 2").count(), 1, "{}", chain(&e));
        let file = tmp("d.jsonl", "");
        let dir = file.with_file_name("a-directory.jsonl");
        std::fs::create_dir_all(&dir).expect("dir");
        let e = read(&dir, None).expect_err("a directory");
        assert!(chain(&e).starts_with(&format!("{}: cannot read: ", dir.display())), "{}", chain(&e));
        assert_eq!(chain(&e).matches("os error").count(), 1, "{}", chain(&e));
    }

    #[test]
    fn sessions_cap_and_spread() {
        let mut body = String::new();
        for turn in 0..10 {
            body.push_str(&format!(
                "{{\"session_id\": \"s1\", \"turn_id\": {turn}, \"timestamp\": {}, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}}\n",
                turn * 1000
            ));
        }
        body.push_str(
            "{\"session_id\": 7, \"turn_id\": 0, \"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\n",
        );
        let p = tmp("s.jsonl", &body);
        let t = read(&p, None).expect("reads");
        assert_eq!(t.len(), 11);
        let capped = cap_sessions(t.clone(), 8);
        assert_eq!(capped.len(), 9);
        let mut burst = vec![t[0].clone(), t[0].clone(), t[0].clone(), t[0].clone()];
        for r in &mut burst {
            r.arrival = Nanos::from_secs(3);
        }
        spread_seconds(&mut burst);
        let ms: Vec<u64> = burst.iter().map(|r| r.arrival.0 / 1_000_000).collect();
        assert_eq!(ms, vec![3000, 3250, 3500, 3750]);
        for r in &mut burst {
            r.arrival = Nanos::from_secs(3);
        }
        let mut again = burst.clone();
        spread_seconds_random(&mut burst, 1);
        spread_seconds_random(&mut again, 1);
        let ns: Vec<u64> = burst.iter().map(|r| r.arrival.0).collect();
        assert_eq!(ns, again.iter().map(|r| r.arrival.0).collect::<Vec<_>>(), "same seed, same instants");
        assert!(ns.windows(2).all(|w| w[0] <= w[1]), "order kept: {ns:?}");
        assert!(ns.iter().all(|&t| (3_000_000_000..4_000_000_000).contains(&t)), "within the second: {ns:?}");
        assert_ne!(ns, vec![3_000_000_000, 3_250_000_000, 3_500_000_000, 3_750_000_000]);
        for r in &mut again {
            r.arrival = Nanos::from_secs(3);
        }
        spread_seconds_random(&mut again, 2);
        assert_ne!(ns, again.iter().map(|r| r.arrival.0).collect::<Vec<_>>(), "another seed, other instants");
        let p = tmp(
            "bad-s.jsonl",
            "{\"turn_id\": 0, \"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"session_id\": null}\n",
        );
        assert!(read(&p, Some(TraceFormat::Session)).expect_err("bad").to_string().contains("`session_id`"));
    }

    #[test]
    fn tenants_are_read_and_isolation_keys_their_blocks_apart() {
        let text = "{\"session_id\": \"s\", \"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2], \"tenant\": \"a\"}\n\
                    {\"session_id\": \"s\", \"timestamp\": 1, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2], \"tenant\": 7}\n\
                    {\"session_id\": \"s\", \"timestamp\": 2, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2]}\n";
        let mut t = read_from(text.as_bytes(), Path::new("t.jsonl"), TraceFormat::Session).expect("trace");
        assert_eq!(t[0].tenant.as_deref(), Some("a"));
        assert_eq!(t[1].tenant.as_deref(), Some("7"));
        assert_eq!(t[2].tenant, None);
        assert_eq!(isolate_tenants(&mut t), 2);
        assert!(t[0].blocks.iter().all(|b| !t[1].blocks.contains(b)), "two tenants share no block");
        assert_eq!(t[2].blocks, vec![BlockHash(1), BlockHash(2)], "no tenant, no salt");
        assert_ne!(t[0].session, t[1].session);
        let bad = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [], \"tenant\": [1]}\n";
        let e = read_from(bad.as_bytes(), Path::new("t.jsonl"), TraceFormat::Mooncake).expect_err("bad tenant");
        assert!(e.to_string().contains("`tenant`"), "{e}");
    }

    #[test]
    fn rescaled_blocks_keep_prefixes_and_proportions() {
        let mut t = vec![TraceRequest {
            tenant: None,
            arrival: Nanos(0),
            input_tokens: 1100,
            output_tokens: 5,
            blocks: vec![BlockHash(1), BlockHash(2), BlockHash(3)],
            block_tokens: 512,
            session: None,
            turn: 0,
        }];
        rescale_blocks(&mut t, 16);
        assert_eq!((t[0].input_tokens, t[0].block_tokens, t[0].blocks.len()), (35, 16, 3));
    }

    #[test]
    fn sampling_is_deterministic() {
        let t: Vec<TraceRequest> = (0..1000)
            .map(|i| TraceRequest {
                tenant: None,
                arrival: Nanos(i),
                input_tokens: 1,
                output_tokens: 1,
                blocks: vec![],
                block_tokens: 512,
                session: None,
                turn: 0,
            })
            .collect();
        let a = sample(t.clone(), 0.3, 9);
        assert_eq!(a, sample(t, 0.3, 9));
        assert!((250..350).contains(&a.len()), "{}", a.len());
    }
}
