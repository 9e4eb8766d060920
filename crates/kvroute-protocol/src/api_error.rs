//! OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}`, as the
//! OpenAI API and vLLM/SGLang servers answer them. With the `axum` feature, an [`ApiError`]
//! is an axum response (status, JSON body, `Retry-After` when set).

use http::StatusCode;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Seconds for a `Retry-After` header (503 admission rejections).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, retry_after: None }
    }
    /// 400 naming `param`.
    pub fn bad_field(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.into()), ..ApiError::new(StatusCode::BAD_REQUEST, message) }
    }
    /// Names the request field.
    pub fn with_param(mut self, p: &str) -> Self {
        self.param = Some(p.into());
        self
    }
    /// Adds `Retry-After`.
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 413 | 414 | 422 | 431 => "invalid_request_error",
            401 | 403 => "authentication_error",
            // OpenAI's API and vLLM's server name a 429 so; clients branch on it.
            429 => "rate_limit_exceeded",
            503 => "service_unavailable",
            // Any other client error (405, 409, 415, …) is the request's, not the server's.
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        use axum::http::{HeaderValue, header};
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_status_has_its_openai_type() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (405, "invalid_request_error"),
            (415, "invalid_request_error"),
            (401, "authentication_error"),
            (429, "rate_limit_exceeded"),
            (503, "service_unavailable"),
            (502, "server_error"),
            (504, "server_error"),
        ] {
            let e = ApiError::new(StatusCode::from_u16(status).expect("status"), "m").with_param("f");
            let b = e.body();
            assert_eq!(b["error"]["type"], kind, "{status}");
            assert_eq!(b["error"]["code"], status);
            assert_eq!(b["error"]["param"], "f");
        }
    }
}
