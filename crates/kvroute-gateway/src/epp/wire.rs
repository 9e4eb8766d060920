//! Envoy ext_proc v3 messages as the endpoint-picker protocol uses them (Gateway API
//! Inference Extension, `docs/proposals/004-endpoint-picker-protocol` in
//! kubernetes-sigs/gateway-api-inference-extension): reading a gateway's headers and
//! metadata, and building the responses — the destination header and `envoy.lb` dynamic
//! metadata, pass-through bodies, immediate responses.

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpValue};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response as Reply,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kvroute_protocol::api_error::ApiError;

/// The header, and the key in the `envoy.lb` dynamic metadata, that name the chosen
/// endpoints (`ip:port`, comma-separated in the order to try).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination and of the endpoint that served.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint: the endpoints the picker must choose among.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The key, in `envoy.lb`, of the endpoint that served the request (response side).
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// Largest body chunk sent back in full-duplex mode, bytes (GIE's reference picker keeps
/// chunks under Envoy's 64 KiB default for the same reason).
pub const MAX_CHUNK: usize = 62_000;
/// Most endpoints read from a subset hint.
pub const MAX_SUBSET: usize = 4096;

/// The request's headers as an HTTP header map, with its `:path` and `:method` apart
/// (pseudo-headers); a header Envoy sends that is not a valid HTTP header is skipped.
pub fn headers_of(h: &HttpHeaders) -> (HeaderMap, String, String) {
    let mut map = HeaderMap::new();
    let (mut path, mut method) = (String::new(), String::new());
    for hv in h.headers.iter().flat_map(|m| m.headers.iter()) {
        let value: &[u8] = if hv.raw_value.is_empty() { hv.value.as_bytes() } else { &hv.raw_value };
        match hv.key.as_str() {
            ":path" => path = String::from_utf8_lossy(value).into_owned(),
            ":method" => method = String::from_utf8_lossy(value).into_owned(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HttpValue::from_bytes(value)) {
                    map.append(n, v);
                }
            }
        }
    }
    (map, path, method)
}

/// The `:status` of response headers (0 when missing or not a number).
pub fn status_of(h: &HttpHeaders) -> u16 {
    h.headers
        .iter()
        .flat_map(|m| m.headers.iter())
        .find(|hv| hv.key == ":status")
        .and_then(|hv| {
            let v: &[u8] = if hv.raw_value.is_empty() { hv.value.as_bytes() } else { &hv.raw_value };
            std::str::from_utf8(v).ok()?.trim().parse().ok()
        })
        .unwrap_or(0)
}

/// Whether response headers say the body is a server-sent event stream.
pub fn is_event_stream(h: &HttpHeaders) -> bool {
    h.headers.iter().flat_map(|m| m.headers.iter()).any(|hv| {
        let v: &[u8] = if hv.raw_value.is_empty() { hv.value.as_bytes() } else { &hv.raw_value };
        hv.key.eq_ignore_ascii_case("content-type") && v.starts_with(b"text/event-stream")
    })
}

fn field<'m>(md: Option<&'m Metadata>, namespace: &str, key: &str) -> Option<&'m Kind> {
    md?.filter_metadata.get(namespace)?.fields.get(key)?.kind.as_ref()
}

/// The subset hint of a request (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`
/// in its filter metadata): a list of `ip:port` strings, or one comma-separated string (as
/// header-to-metadata filters write it), at most [`MAX_SUBSET`]. `None` when not set; an
/// empty list when set empty (then no endpoint is eligible: 503).
pub fn subset_of(req: &ProcessingRequest) -> Option<Vec<String>> {
    let split = |s: &str, out: &mut Vec<String>| {
        out.extend(s.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::to_string));
    };
    let mut out = Vec::new();
    match field(req.metadata_context.as_ref(), SUBSET_NAMESPACE, SUBSET)? {
        Kind::StringValue(s) => split(s, &mut out),
        Kind::ListValue(l) => {
            for v in &l.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    split(s, &mut out);
                }
            }
        }
        _ => {}
    }
    out.truncate(MAX_SUBSET);
    Some(out)
}

/// The endpoint that served the request, as the gateway reports it on the response side
/// (`envoy.lb` / `x-gateway-destination-endpoint-served` in the metadata context).
pub fn served_of(req: &ProcessingRequest) -> Option<String> {
    match field(req.metadata_context.as_ref(), LB_NAMESPACE, SERVED)? {
        Kind::StringValue(s) => Some(s.trim().to_string()),
        _ => None,
    }
}

/// The body modes the gateway announced (`protocol_config`, Envoy ≥ 1.33): request and
/// response [`BodySendMode`]s.
pub fn announced_modes(req: &ProcessingRequest) -> Option<(BodySendMode, BodySendMode)> {
    let p = req.protocol_config.as_ref()?;
    let mode = |m: i32| BodySendMode::try_from(m).unwrap_or(BodySendMode::None);
    Some((mode(p.request_body_mode), mode(p.response_body_mode)))
}

/// Sets `key` to `value`, replacing any value the request or response had: the protocol's
/// default append action would add to a destination header the client sent itself.
fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.into())) }
}

/// The destination as the protocol asks for it: the header set (with the route cache
/// cleared, so the gateway routes on it) and the same value in the `envoy.lb` dynamic
/// metadata; `body` replaces the request body when given (buffered mode).
fn destination(endpoints: &str, body: Option<Vec<u8>>) -> (CommonResponse, Struct) {
    let mut headers = vec![set(DESTINATION, endpoints)];
    if let Some(b) = &body {
        headers.push(set("content-length", &b.len().to_string()));
    }
    let common = CommonResponse {
        // kvroute's admin token, if a client sent it to see decisions, goes no further.
        header_mutation: Some(HeaderMutation {
            set_headers: headers,
            remove_headers: vec![crate::tenant::ADMIN_TOKEN_HEADER.to_string()],
        }),
        body_mutation: body.map(|b| BodyMutation { mutation: Some(body_mutation::Mutation::Body(b)) }),
        clear_route_cache: true,
        ..Default::default()
    };
    let inner = Struct { fields: [(DESTINATION.to_string(), string(endpoints))].into_iter().collect() };
    let md = Struct {
        fields: [(LB_NAMESPACE.to_string(), Value { kind: Some(Kind::StructValue(inner)) })].into_iter().collect(),
    };
    (common, md)
}

/// The request headers' response naming the destination (full-duplex mode, or a request
/// without a body).
pub fn route_on_headers(endpoints: &str) -> ProcessingResponse {
    let (common, md) = destination(endpoints, None);
    ProcessingResponse {
        response: Some(Reply::RequestHeaders(HeadersResponse { response: Some(common) })),
        dynamic_metadata: Some(md),
        ..Default::default()
    }
}

/// The request body's response naming the destination (buffered mode), replacing the body
/// with `body` when given.
pub fn route_on_body(endpoints: &str, body: Option<Vec<u8>>) -> ProcessingResponse {
    let (common, md) = destination(endpoints, body);
    ProcessingResponse {
        response: Some(Reply::RequestBody(BodyResponse { response: Some(common) })),
        dynamic_metadata: Some(md),
        ..Default::default()
    }
}

/// "Go on, unchanged" for request headers.
pub fn continue_request_headers() -> ProcessingResponse {
    reply(Reply::RequestHeaders(HeadersResponse::default()))
}

/// Response headers, with `set` headers added (the decision headers, for clients that may
/// see them).
pub fn response_headers(set_headers: &[(&str, &str)]) -> ProcessingResponse {
    let mutation = (!set_headers.is_empty()).then(|| HeaderMutation {
        set_headers: set_headers.iter().map(|(k, v)| set(k, v)).collect(),
        ..Default::default()
    });
    reply(Reply::ResponseHeaders(HeadersResponse {
        response: Some(CommonResponse { header_mutation: mutation, ..Default::default() }),
    }))
}

/// A body chunk passed on: in full-duplex mode, `chunk` itself sent back (the data plane
/// forwards only what the processor returns), split under [`MAX_CHUNK`]; else "unchanged".
pub fn body_replies(request_side: bool, full_duplex: bool, chunk: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let wrap = |common: CommonResponse| {
        let b = BodyResponse { response: Some(common) };
        reply(if request_side { Reply::RequestBody(b) } else { Reply::ResponseBody(b) })
    };
    if !full_duplex {
        return vec![wrap(CommonResponse::default())];
    }
    let streamed = |body: &[u8], end_of_stream: bool| {
        wrap(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: body.to_vec(),
                    end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        })
    };
    if chunk.is_empty() {
        return vec![streamed(chunk, end)];
    }
    let n = chunk.len().div_ceil(MAX_CHUNK);
    chunk.chunks(MAX_CHUNK).enumerate().map(|(i, c)| streamed(c, end && i + 1 == n)).collect()
}

/// Trailers passed on unchanged (request or response side).
pub fn trailers(request_side: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    reply(if request_side { Reply::RequestTrailers(t) } else { Reply::ResponseTrailers(t) })
}

/// kvroute answers the request itself: `e`'s status and OpenAI-style JSON body, as `serve`
/// answers it (with `Retry-After` when `e` carries one).
pub fn immediate(e: &ApiError) -> ProcessingResponse {
    let mut headers = vec![set("content-type", "application/json")];
    if let Some(secs) = e.retry_after {
        headers.push(set("retry-after", &secs.to_string()));
    }
    reply(Reply::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(e.status.as_u16()) }),
        headers: Some(HeaderMutation { set_headers: headers, ..Default::default() }),
        body: e.body().to_string().into_bytes(),
        details: "kvroute".into(),
        ..Default::default()
    }))
}

fn reply(r: Reply) -> ProcessingResponse {
    ProcessingResponse { response: Some(r), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap as EnvoyHeaders;
    use envoy_types::pb::google::protobuf::ListValue;

    fn with_metadata(namespace: &str, key: &str, v: Kind) -> ProcessingRequest {
        let inner = Struct { fields: [(key.to_string(), Value { kind: Some(v) })].into_iter().collect() };
        ProcessingRequest {
            metadata_context: Some(Metadata {
                filter_metadata: [(namespace.to_string(), inner)].into_iter().collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        let list = Kind::ListValue(ListValue {
            values: vec![string("10.0.0.1:8000"), string(" 10.0.0.2:8000 , 10.0.0.3:8000")],
        });
        assert_eq!(
            subset_of(&with_metadata(SUBSET_NAMESPACE, SUBSET, list)),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into(), "10.0.0.3:8000".into()])
        );
        let flat = Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into());
        assert_eq!(subset_of(&with_metadata(SUBSET_NAMESPACE, SUBSET, flat)).map(|v| v.len()), Some(2));
        assert_eq!(subset_of(&with_metadata(SUBSET_NAMESPACE, SUBSET, Kind::StringValue(String::new()))), Some(vec![]));
        assert_eq!(subset_of(&ProcessingRequest::default()), None);
        let served = with_metadata(LB_NAMESPACE, SERVED, Kind::StringValue("10.0.0.2:8000".into()));
        assert_eq!(served_of(&served).as_deref(), Some("10.0.0.2:8000"));
    }

    #[test]
    fn headers_keep_raw_values_and_set_pseudo_headers_apart() {
        let hv = |k: &str, raw: &[u8]| HeaderValue { key: k.into(), raw_value: raw.to_vec(), ..Default::default() };
        let h = HttpHeaders {
            headers: Some(EnvoyHeaders {
                headers: vec![
                    hv(":path", b"/v1/chat/completions"),
                    hv(":method", b"POST"),
                    hv(":authority", b"gw"),
                    hv("x-session-id", b"s1"),
                    hv("bad header", b"x"),
                ],
            }),
            ..Default::default()
        };
        let (map, path, method) = headers_of(&h);
        assert_eq!((path.as_str(), method.as_str()), ("/v1/chat/completions", "POST"));
        assert_eq!(map.get("x-session-id").map(|v| v.as_bytes()), Some(&b"s1"[..]));
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn the_destination_is_in_the_header_and_the_lb_metadata_alike() {
        let r = route_on_headers("10.0.0.1:8000,10.0.0.2:8000");
        let Some(Reply::RequestHeaders(h)) = &r.response else { panic!("headers response") };
        let common = h.response.as_ref().expect("common");
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().expect("mutation").set_headers[0];
        let header = set.header.as_ref().expect("header");
        assert_eq!((header.key.as_str(), &header.raw_value[..]), (DESTINATION, &b"10.0.0.1:8000,10.0.0.2:8000"[..]));
        // A destination the client sent itself is replaced, not appended to.
        assert_eq!(set.append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
        let md = r.dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else { panic!("envoy.lb struct") };
        assert_eq!(lb.fields[DESTINATION].kind, Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into())));
    }

    #[test]
    fn full_duplex_bodies_come_back_whole_in_bounded_chunks() {
        let body = vec![b'x'; 2 * MAX_CHUNK + 5];
        let replies = body_replies(true, true, &body, true);
        assert_eq!(replies.len(), 3);
        let mut back = Vec::new();
        for (i, r) in replies.iter().enumerate() {
            let Some(Reply::RequestBody(b)) = &r.response else { panic!("body response") };
            let m = b.response.as_ref().and_then(|c| c.body_mutation.as_ref()).and_then(|m| m.mutation.as_ref());
            let Some(body_mutation::Mutation::StreamedResponse(s)) = m else { panic!("streamed") };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 2);
            back.extend_from_slice(&s.body);
        }
        assert_eq!(back, body);
        assert_eq!(body_replies(false, false, b"abc", false).len(), 1);
    }
}
