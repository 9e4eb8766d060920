//! Local tokenization for token-accurate routing keys, with no tokenizer round trip per
//! request.
//!
//! A [`LocalTokenizer`] renders a chat request with the model's own Jinja chat template and
//! encodes the prompt with the model's own vocabulary, the way the worker will, so the
//! request's token ids (and so its block hashes and exact prompt length) match what the
//! worker caches. Two sources:
//!
//! - a **GGUF model file** (llama.cpp workers): vocabulary, merges, token types, BOS/EOS and
//!   chat template come from the `tokenizer.*` metadata; the pre-tokenizer is chosen from
//!   `tokenizer.ggml.pre` with llama.cpp's own split rules (`llama-vocab.cpp`): the
//!   `smollm`/`starcoder`, `gpt-2`, `llama-bpe` (llama3) and `qwen2` families. Encoded as
//!   llama-server encodes a chat prompt: special tokens parsed, BOS prepended when
//!   `tokenizer.ggml.add_bos_token` is true.
//! - a Hugging Face **`tokenizer.json`** (vLLM, SGLang workers), with `chat_template`,
//!   `bos_token` and `eos_token` from the `tokenizer_config.json` beside it. Chat prompts are
//!   encoded without added special tokens (vLLM's and SGLang's default for chat), completion
//!   prompts with them.
//!
//! Requests the local tokenizer cannot reproduce exactly (tool definitions, non-string
//! message content, a template error) are reported as not tokenized and routed on their
//! text instead: a wrong key is worse than an approximate one.
//!
//! Library choices (STYLE.md): `tokenizers` without its C regex engine, `minijinja` with
//! `minijinja-contrib`'s Python string methods (templates call `.strip()` and friends),
//! `gguf-rs` for the GGUF metadata.

use std::path::Path;

/// Largest tokenizer array read from a GGUF file (vocabulary or merges entries).
const MAX_GGUF_ARRAY: u64 = 1 << 22;
/// Template instructions one render may execute (bounds a pathological template or request).
const TEMPLATE_FUEL: u64 = 50_000_000;

/// Why a tokenizer could not be loaded: the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer `{path}`: {message}")]
pub struct TokenizerLoadError {
    /// The file given.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// Why one request was not tokenized locally (a metric label; the request is routed on its
/// text).
pub type NotTokenized = &'static str;

/// A model's tokenizer and chat template, loaded once at startup.
pub struct LocalTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<minijinja::Environment<'static>>,
    bos_token: String,
    eos_token: String,
    /// Token prepended to every prompt encoded with special tokens (GGUF `add_bos_token`).
    prepend: Option<u32>,
    /// Token appended likewise (GGUF `add_eos_token`).
    append: Option<u32>,
    /// Whether chat prompts are encoded with special tokens added (llama.cpp: yes; vLLM: no).
    chat_add_special: bool,
    source: String,
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("source", &self.source)
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn err(path: &Path, message: impl Into<String>) -> TokenizerLoadError {
    TokenizerLoadError { path: path.display().to_string(), message: message.into() }
}

/// The pre-tokenizer (as `tokenizer.json` JSON) reproducing llama.cpp's split rules for a
/// GGUF `tokenizer.ggml.pre` value; `None` for one not supported here.
fn gguf_pre_tokenizer(pre: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    // llama.cpp LLAMA3 / QWEN2 regexes (llama-vocab.cpp), case-insensitive contractions.
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let seq = |v: Vec<serde_json::Value>| json!({"type": "Sequence", "pretokenizers": v});
    Some(match pre {
        // Digits one by one, then GPT-2's split (llama.cpp's STARCODER group).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            seq(vec![json!({"type": "Digits", "individual_digits": true}), byte_level(true)])
        }
        "gpt-2" | "mpt" | "olmo" | "jais" | "trillion" | "default" => byte_level(true),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            seq(vec![split(LLAMA3), byte_level(false)])
        }
        "qwen2" | "stablelm2" | "hunyuan" | "deepseek-r1-qwen" | "megrez" => seq(vec![split(QWEN2), byte_level(false)]),
        _ => return None,
    })
}

/// A GGUF file's metadata, read for its tokenizer (errors name the file).
struct GgufMeta<'a> {
    path: &'a Path,
    md: &'a std::collections::BTreeMap<String, serde_json::Value>,
}

impl<'a> GgufMeta<'a> {
    /// A string value.
    fn str(&self, k: &str) -> Option<&'a str> {
        self.md.get(k).and_then(serde_json::Value::as_str)
    }

    /// An integer value, as `u32`.
    fn u32(&self, k: &str) -> Option<u32> {
        self.md.get(k).and_then(serde_json::Value::as_u64).map(|v| v as u32)
    }

    /// A boolean value.
    fn bool(&self, k: &str) -> Option<bool> {
        self.md.get(k).and_then(serde_json::Value::as_bool)
    }

    /// The pre-tokenizer of a BPE `gpt2` model; other models, and pre-tokenizers this module
    /// does not reproduce, are refused.
    fn bpe_pre_tokenizer(&self) -> Result<serde_json::Value, TokenizerLoadError> {
        let path = self.path;
        let kind = self.str("tokenizer.ggml.model").ok_or_else(|| err(path, "no `tokenizer.ggml.model` metadata"))?;
        if kind != "gpt2" {
            return Err(err(
                path,
                format!("tokenizer model `{kind}` is not supported locally (only BPE `gpt2`); give a tokenizer.json"),
            ));
        }
        let pre_name = self.str("tokenizer.ggml.pre").unwrap_or("default");
        gguf_pre_tokenizer(pre_name).ok_or_else(|| {
            err(path, format!("pre-tokenizer `{pre_name}` is not supported locally; give a tokenizer.json"))
        })
    }

    /// A string array of the metadata, refused when missing or possibly truncated (gguf-rs
    /// keeps the first MAX_GGUF_ARRAY entries).
    fn strings(&self, k: &str) -> Result<Vec<&'a str>, TokenizerLoadError> {
        let a = self
            .md
            .get(k)
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| err(self.path, format!("no `{k}` metadata")))?;
        if a.len() as u64 >= MAX_GGUF_ARRAY {
            return Err(err(self.path, format!("`{k}` has {MAX_GGUF_ARRAY} entries or more")));
        }
        Ok(a.iter().map(|t| t.as_str().unwrap_or_default()).collect())
    }

    /// Each token's type (`tokenizer.ggml.token_type`; 1, normal, where unreadable).
    fn token_types(&self) -> Vec<i64> {
        self.md
            .get("tokenizer.ggml.token_type")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().map(|t| t.as_i64().unwrap_or(1)).collect())
            .unwrap_or_default()
    }
}

/// The byte-level BPE tokenizer of a GGUF vocabulary: its tokens, merges and token types,
/// with `pre` as the pre-tokenizer.
fn bpe_tokenizer(
    path: &Path,
    tokens: &[&str],
    merges: &[&str],
    types: &[i64],
    pre: serde_json::Value,
) -> Result<tokenizers::Tokenizer, TokenizerLoadError> {
    let vocab: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| ((*t).to_string(), serde_json::Value::from(i))).collect();
    // Control (3) and user-defined (4) tokens are matched whole in the text, as
    // llama-server does with parse_special.
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3 | 4)))
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": types.get(i) == Some(&3)})
        })
        .collect();
    let spec = serde_json::json!({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    let bytes = serde_json::to_vec(&spec).map_err(|e| err(path, e.to_string()))?;
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| err(path, format!("vocabulary does not build a BPE tokenizer: {e}")))
}

fn chat_env(path: &Path, template: &str) -> Result<minijinja::Environment<'static>, TokenizerLoadError> {
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned("chat", template.to_string())
        .map_err(|e| err(path, format!("chat template does not parse: {e}")))?;
    Ok(env)
}

impl LocalTokenizer {
    /// Loads a GGUF model file's tokenizer (`*.gguf`, by its magic) or a Hugging Face
    /// `tokenizer.json`.
    ///
    /// # Errors
    /// The file cannot be read; it is neither format; a GGUF tokenizer model or
    /// pre-tokenizer this module does not reproduce (only BPE `gpt2` models with the
    /// pre-tokenizer families listed in the module docs); a chat template that does not parse.
    pub fn load(path: &Path) -> Result<LocalTokenizer, TokenizerLoadError> {
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = std::fs::File::open(path).map_err(|e| err(path, format!("cannot open: {e}")))?;
            let _ = f.read(&mut magic);
        }
        if &magic == b"GGUF" { Self::from_gguf(path) } else { Self::from_tokenizer_json(path) }
    }

    /// Loads the tokenizer and chat template from a GGUF file's metadata.
    ///
    /// # Errors
    /// As [`LocalTokenizer::load`].
    pub fn from_gguf(path: &Path) -> Result<LocalTokenizer, TokenizerLoadError> {
        let p = path.to_str().ok_or_else(|| err(path, "path is not UTF-8"))?;
        let mut c = gguf_rs::get_gguf_container_array_size(p, MAX_GGUF_ARRAY)
            .map_err(|e| err(path, format!("not a GGUF file: {e}")))?;
        let model = c.decode().map_err(|e| err(path, format!("GGUF metadata does not decode: {e}")))?;
        let md = GgufMeta { path, md: model.metadata() };
        let pre = md.bpe_pre_tokenizer()?;
        let tokens = md.strings("tokenizer.ggml.tokens")?;
        let merges = md.strings("tokenizer.ggml.merges")?;
        let tokenizer = bpe_tokenizer(path, &tokens, &merges, &md.token_types(), pre)?;
        let token_text = |k: &str| md.u32(k).and_then(|i| tokens.get(i as usize)).map(|t| (*t).to_string());
        let template = md.str("tokenizer.chat_template").map(|t| chat_env(path, t)).transpose()?;
        Ok(LocalTokenizer {
            tokenizer,
            template,
            bos_token: token_text("tokenizer.ggml.bos_token_id").unwrap_or_default(),
            eos_token: token_text("tokenizer.ggml.eos_token_id").unwrap_or_default(),
            prepend: md
                .bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(false)
                .then(|| md.u32("tokenizer.ggml.bos_token_id"))
                .flatten(),
            append: md
                .bool("tokenizer.ggml.add_eos_token")
                .unwrap_or(false)
                .then(|| md.u32("tokenizer.ggml.eos_token_id"))
                .flatten(),
            chat_add_special: true,
            source: format!("gguf:{}", path.display()),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`, with the chat template and special tokens of
    /// the `tokenizer_config.json` beside it when there is one.
    ///
    /// # Errors
    /// As [`LocalTokenizer::load`].
    pub fn from_tokenizer_json(path: &Path) -> Result<LocalTokenizer, TokenizerLoadError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| err(path, format!("neither a GGUF file nor a loadable tokenizer.json: {e}")))?;
        let cfg_path = path.with_file_name("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| err(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(_) => serde_json::Value::Null,
        };
        // Special tokens are strings or `{"content": ...}` objects.
        let special = |k: &str| match cfg.get(k) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.get("content").and_then(serde_json::Value::as_str).unwrap_or_default().to_string(),
            None => String::new(),
        };
        let template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(chat_env(&cfg_path, t)?),
            // A list of named templates: the `default` one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(serde_json::Value::as_str))
                .map(|t| chat_env(&cfg_path, t))
                .transpose()?,
            _ => None,
        };
        Ok(LocalTokenizer {
            tokenizer,
            template,
            bos_token: special("bos_token"),
            eos_token: special("eos_token"),
            prepend: None,
            append: None,
            chat_add_special: false,
            source: format!("tokenizer.json:{}", path.display()),
        })
    }

    /// Where this tokenizer came from (`gguf:PATH` or `tokenizer.json:PATH`).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Token ids of `text`, with the model's special tokens added when `add_special` (BOS
    /// for GGUF models whose metadata asks for it; the `tokenizer.json` post-processor).
    /// Special-token text inside `text` (`<|im_start|>`) encodes as the special token.
    ///
    /// # Errors
    /// `"tokenizer_error"` if the tokenizer fails on the input.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, NotTokenized> {
        let enc = self.tokenizer.encode_fast(text, add_special).map_err(|_| "tokenizer_error")?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        if add_special && let Some(b) = self.prepend {
            out.push(b);
        }
        out.extend_from_slice(ids);
        if add_special && let Some(e) = self.append {
            out.push(e);
        }
        Ok(out)
    }

    /// The chat prompt text of an OpenAI chat request body, rendered with the model's chat
    /// template (`add_generation_prompt` from the body, default true).
    ///
    /// # Errors
    /// `"no_chat_template"`; `"unsupported_request"` for tools, template kwargs, or a message
    /// whose content is not a string (the engine's own rendering of those is not reproduced);
    /// `"template_error"` when rendering fails.
    pub fn render_chat(&self, body: &serde_json::Value) -> Result<String, NotTokenized> {
        let env = self.template.as_ref().ok_or("no_chat_template")?;
        let msgs = body.get("messages").and_then(serde_json::Value::as_array).ok_or("unsupported_request")?;
        for k in ["tools", "functions", "chat_template_kwargs", "chat_template"] {
            if body.get(k).is_some_and(|v| !v.is_null()) {
                return Err("unsupported_request");
            }
        }
        for m in msgs {
            let ok = m.get("role").is_some_and(serde_json::Value::is_string)
                && m.get("content").is_some_and(serde_json::Value::is_string)
                && m.get("tool_calls").is_none_or(serde_json::Value::is_null);
            if !ok {
                return Err("unsupported_request");
            }
        }
        let add_generation_prompt =
            body.get("add_generation_prompt").and_then(serde_json::Value::as_bool).unwrap_or(true);
        let tmpl = env.get_template("chat").map_err(|_| "template_error")?;
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(msgs)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|_| "template_error")
    }

    /// The prompt token ids of a request body as its worker will see them: a chat request's
    /// rendered template, or a completion/generate text prompt.
    ///
    /// # Errors
    /// As [`LocalTokenizer::render_chat`] and [`LocalTokenizer::encode`];
    /// `"unsupported_request"` for prompts that are not one string.
    pub fn request_tokens(
        &self,
        api: kvroute_protocol::openai::Api,
        body: &serde_json::Value,
    ) -> Result<Vec<u32>, NotTokenized> {
        use kvroute_protocol::openai::Api;
        match api {
            Api::Chat => {
                let text = self.render_chat(body)?;
                self.encode(&text, self.chat_add_special)
            }
            Api::Completions | Api::Generate => {
                let field = if api == Api::Completions { "prompt" } else { "text" };
                let text = match body.get(field) {
                    Some(serde_json::Value::String(s)) => s.as_str(),
                    Some(serde_json::Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                        a[0].as_str().unwrap_or_default()
                    }
                    _ => return Err("unsupported_request"),
                };
                self.encode(text, true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny byte-level BPE `tokenizer.json` + `tokenizer_config.json` written to a temp dir.
    fn tiny_hf(dir: &Path) -> std::path::PathBuf {
        // Byte-level alphabet for the characters used below, then two merges.
        let mut vocab = serde_json::Map::new();
        for (i, c) in ["<s>", "<|im_start|>", "<|im_end|>", "h", "i", "Ċ", "u", "s", "e", "r", "a", "t", "hi", "us"]
            .iter()
            .enumerate()
        {
            vocab.insert((*c).to_string(), i.into());
        }
        let tj = serde_json::json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": ["h i", "u s"]},
        });
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, serde_json::to_vec(&tj).unwrap()).unwrap();
        let cfg = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "eos_token": "<|im_end|>",
            "chat_template": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'].strip() + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}",
        });
        std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
        p
    }

    /// A fresh directory, removed when the guard drops (also on a panic).
    fn tempdir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("kvroute-tok-{name}-")).tempdir().expect("temp dir")
    }

    #[test]
    fn hf_tokenizer_renders_the_chat_template_and_encodes_without_added_specials() {
        let dir = tempdir("hf");
        let t = LocalTokenizer::load(&tiny_hf(dir.path())).unwrap();
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": " hi "}]});
        // pycompat's `.strip()` ran; the template's special tokens encode as themselves.
        assert_eq!(t.render_chat(&body).unwrap(), "<|im_start|>user\nhi<|im_end|><|im_start|>");
        // <|im_start|> u s e r \n hi <|im_end|> <|im_start|>; no BOS for chat (vLLM's default).
        assert_eq!(
            t.request_tokens(kvroute_protocol::openai::Api::Chat, &body).unwrap(),
            vec![1, 13, 8, 9, 5, 12, 2, 1]
        );
        // Completions get the post-processor's BOS.
        let c = serde_json::json!({"model": "m", "prompt": "hi"});
        assert_eq!(t.request_tokens(kvroute_protocol::openai::Api::Completions, &c).unwrap(), vec![0, 12]);
    }

    #[test]
    fn requests_it_cannot_reproduce_are_refused_not_guessed() {
        let dir = tempdir("refuse");
        let t = LocalTokenizer::load(&tiny_hf(dir.path())).unwrap();
        let api = kvroute_protocol::openai::Api::Chat;
        let parts = serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        assert_eq!(t.request_tokens(api, &parts), Err("unsupported_request"));
        let tools =
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]});
        assert_eq!(t.request_tokens(api, &tools), Err("unsupported_request"));
        let many = serde_json::json!({"prompt": ["a", "b"]});
        assert_eq!(t.request_tokens(kvroute_protocol::openai::Api::Completions, &many), Err("unsupported_request"));
    }

    #[test]
    fn bad_files_name_the_file_and_the_problem() {
        let dir = tempdir("bad");
        let missing = dir.path().join("nope.gguf");
        let e = LocalTokenizer::load(&missing).unwrap_err();
        assert!(e.to_string().contains("nope.gguf") && e.to_string().contains("cannot open"), "{e}");
        let junk = dir.path().join("junk.json");
        std::fs::write(&junk, b"{\"not\": \"a tokenizer\"}").unwrap();
        let e = LocalTokenizer::load(&junk).unwrap_err();
        assert!(e.to_string().contains("junk.json") && e.to_string().contains("tokenizer.json"), "{e}");
        let fake = dir.path().join("fake.gguf");
        std::fs::write(&fake, b"GGUF\x03\x00\x00\x00").unwrap();
        let e = LocalTokenizer::load(&fake).unwrap_err();
        assert!(e.to_string().contains("fake.gguf") && e.to_string().contains("GGUF"), "{e}");
    }

    #[test]
    fn every_supported_gguf_pre_tokenizer_builds() {
        for pre in ["smollm", "gpt-2", "llama-bpe", "qwen2"] {
            let spec = serde_json::json!({"version": "1.0", "added_tokens": [], "normalizer": null,
                "pre_tokenizer": gguf_pre_tokenizer(pre).unwrap(), "post_processor": null, "decoder": null,
                "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}});
            let t = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&spec).unwrap());
            assert!(t.is_ok(), "{pre}: {:?}", t.err());
        }
        assert!(gguf_pre_tokenizer("no-such-pre").is_none());
    }
}
