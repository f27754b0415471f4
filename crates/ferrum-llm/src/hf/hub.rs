//! Downloading files of a Hugging Face hub repository:
//! `GET {endpoint}/{repo}/resolve/{revision}/{file}`.
//!
//! The endpoint is `HF_ENDPOINT` or `https://huggingface.co`; `HF_TOKEN` (if set) is sent as a bearer
//! token to the endpoint's host only, never to the hosts it redirects to. Redirects are followed,
//! each file is written to a temporary name beside its destination and renamed when complete, and
//! files already present are skipped.
//!
//! This build speaks plain HTTP/1.1 over `std::net` and carries no TLS stack: an `https://` URL
//! (including the default endpoint, and redirects to https CDNs) is an [`Error::Unsupported`]
//! naming it. Point `HF_ENDPOINT` at an `http://` mirror, or fetch the files with another tool and
//! load the folder.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferrum_core::{Error, Result};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

const MAX_REDIRECTS: usize = 10;
const MAX_HEADER_LINE: u64 = 16 << 10;
const MAX_HEADERS: usize = 200;

/// Where the hub is and how to authenticate.
#[derive(Clone)]
pub struct HubClient {
    /// Base URL, e.g. `https://huggingface.co` or `http://127.0.0.1:8080` (no trailing slash needed).
    pub endpoint: String,
    /// Bearer token for gated or private repositories.
    pub token: Option<String>,
    /// Connect and per-read timeout.
    pub timeout: Duration,
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Downloads `files` of `repo_id` at `revision` into `dest_dir`, using `HF_ENDPOINT` and `HF_TOKEN`
/// from the environment. Returns the local paths, in the order of `files`.
pub fn download(
    repo_id: &str,
    revision: &str,
    files: &[&str],
    dest_dir: &Path,
) -> Result<Vec<PathBuf>> {
    HubClient::from_env().download(repo_id, revision, files, dest_dir)
}

impl HubClient {
    /// A client for `endpoint` without a token.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            token: None,
            timeout: Duration::from_secs(60),
        }
    }

    /// `HF_ENDPOINT` (default [`DEFAULT_ENDPOINT`]) and `HF_TOKEN` (empty means none).
    pub fn from_env() -> Self {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Self::new(endpoint).with_token(std::env::var("HF_TOKEN").ok().filter(|s| !s.is_empty()))
    }

    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// The URL of one file of a repository.
    pub fn file_url(&self, repo_id: &str, revision: &str, file: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint.trim_end_matches('/'),
            encode_path(repo_id),
            encode_path(revision),
            encode_path(file)
        )
    }

    /// Downloads `files` (paths inside the repository, `/`-separated) into `dest_dir`, skipping
    /// those already there. Returns the local paths, in the order of `files`.
    pub fn download(
        &self,
        repo_id: &str,
        revision: &str,
        files: &[&str],
        dest_dir: &Path,
    ) -> Result<Vec<PathBuf>> {
        let mut out = Vec::with_capacity(files.len());
        for &file in files {
            out.push(self.download_file(repo_id, revision, file, dest_dir)?);
        }
        Ok(out)
    }

    /// Downloads what [`crate::Llm::load_hf`] reads: `config.json`, `tokenizer.json`, the
    /// optional `tokenizer_config.json` and `chat_template.jinja`, and the weights (the shards of
    /// `model.safetensors.index.json` when the repository has one, else `model.safetensors`).
    pub fn download_model(
        &self,
        repo_id: &str,
        revision: &str,
        dest_dir: &Path,
    ) -> Result<Vec<PathBuf>> {
        let mut got = self.download(
            repo_id,
            revision,
            &["config.json", "tokenizer.json"],
            dest_dir,
        )?;
        for optional in ["tokenizer_config.json", "chat_template.jinja"] {
            if let Some(p) = self.download_optional(repo_id, revision, optional, dest_dir)? {
                got.push(p);
            }
        }
        match self.download_optional(repo_id, revision, "model.safetensors.index.json", dest_dir)? {
            Some(index) => {
                let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| Error::msg(format!("{}: invalid JSON: {e}", index.display())))?;
                let mut shards: Vec<&str> = v
                    .get("weight_map")
                    .and_then(|m| m.as_object())
                    .ok_or_else(|| {
                        Error::msg(format!("{}: no weight_map object", index.display()))
                    })?
                    .values()
                    .filter_map(|f| f.as_str())
                    .collect();
                shards.sort_unstable();
                shards.dedup();
                got.push(index.clone());
                got.extend(self.download(repo_id, revision, &shards, dest_dir)?);
            }
            None => {
                got.extend(self.download(repo_id, revision, &["model.safetensors"], dest_dir)?)
            }
        }
        Ok(got)
    }

    /// Like one file of [`HubClient::download`], but a missing file is `Ok(None)`.
    fn download_optional(
        &self,
        repo: &str,
        rev: &str,
        file: &str,
        dest: &Path,
    ) -> Result<Option<PathBuf>> {
        match self.download_file(repo, rev, file, dest) {
            Ok(p) => Ok(Some(p)),
            Err(FetchError::NotFound(_)) => Ok(None),
            Err(FetchError::Other(e)) => Err(e),
        }
    }

    fn download_file(
        &self,
        repo: &str,
        rev: &str,
        file: &str,
        dest_dir: &Path,
    ) -> std::result::Result<PathBuf, FetchError> {
        let dest = local_path(dest_dir, file)?;
        if dest.is_file() {
            return Ok(dest);
        }
        let parent = dest.parent().unwrap_or(dest_dir);
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let leaf = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Unique per process and call, so concurrent downloads never share a temporary file.
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = parent.join(format!(".{leaf}.{}-{seq}.part", std::process::id()));
        let url = self.file_url(repo, rev, file);
        let result = self.fetch_to(&url, &tmp).map_err(|e| match e {
            FetchError::NotFound(_) => FetchError::NotFound(Error::msg(format!(
                "file {file} not found in repo {repo} (revision {rev}) at {}",
                self.endpoint
            ))),
            other => other,
        });
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &dest).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(&dest, e)
        })?;
        Ok(dest)
    }

    /// GETs `url` (following redirects) into the file `tmp`.
    fn fetch_to(&self, url: &str, tmp: &Path) -> std::result::Result<(), FetchError> {
        let origin = Url::parse(url)?;
        let mut current = origin.clone();
        for _ in 0..=MAX_REDIRECTS {
            // The token goes to the endpoint's own host only.
            let token = self
                .token
                .as_deref()
                .filter(|_| current.same_origin(&origin));
            let mut resp = request(&current, token, self.timeout)?;
            match resp.status {
                200 => {
                    let file = std::fs::File::create(tmp).map_err(|e| Error::io(tmp, e))?;
                    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
                    resp.copy_body(&mut w, &current)?;
                    w.flush().map_err(|e| Error::io(tmp, e))?;
                    return Ok(());
                }
                301 | 302 | 303 | 307 | 308 => {
                    let loc = resp.header("location").ok_or_else(|| {
                        Error::msg(format!("HTTP {} redirect without a Location from {current}", resp.status))
                    })?;
                    current = current.join(loc)?;
                }
                404 => return Err(FetchError::NotFound(Error::msg(format!("{current}: HTTP 404")))),
                401 | 403 => {
                    return Err(Error::msg(format!(
                        "HTTP {} {} for {url}: the repository is gated or private; set HF_TOKEN to a token with access{}",
                        resp.status,
                        resp.reason,
                        resp.error_message()
                    ))
                    .into())
                }
                s => {
                    return Err(Error::msg(format!(
                        "HTTP {s} {} fetching {current}{}",
                        resp.reason,
                        resp.error_message()
                    ))
                    .into())
                }
            }
        }
        Err(Error::msg(format!(
            "more than {MAX_REDIRECTS} redirects fetching {url}"
        ))
        .into())
    }
}

/// A download failure; 404s are kept apart so optional files can be skipped.
enum FetchError {
    NotFound(Error),
    Other(Error),
}

impl From<Error> for FetchError {
    fn from(e: Error) -> Self {
        FetchError::Other(e)
    }
}

impl From<FetchError> for Error {
    fn from(e: FetchError) -> Self {
        match e {
            FetchError::NotFound(e) | FetchError::Other(e) => e,
        }
    }
}

/// Where repository file `file` goes under `dest_dir`; rejects absolute paths and `..`.
fn local_path(dest_dir: &Path, file: &str) -> Result<PathBuf> {
    let rel = Path::new(file);
    let ok = !file.is_empty()
        && !file.contains('\\')
        && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if !ok {
        return Err(Error::msg(format!("invalid repository file name '{file}'")));
    }
    Ok(dest_dir.join(rel))
}

/// Percent-encodes a URL path, keeping `/` and RFC 3986 unreserved characters.
fn encode_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Resolves `.` and `..` segments of an absolute path (RFC 3986 section 5.2.4).
fn remove_dot_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    for (i, seg) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match *seg {
            "." | ".." => {
                if *seg == ".." {
                    out.pop();
                }
                if last {
                    out.push("");
                }
            }
            s => out.push(s),
        }
    }
    format!("/{}", out.join("/"))
}

/// An `http://` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Url {
    host: String,
    port: u16,
    /// Path and query, starting with `/`.
    path: String,
}

impl Url {
    fn parse(s: &str) -> Result<Url> {
        let Some(rest) = s.strip_prefix("http://") else {
            if s.starts_with("https://") {
                return Err(Error::Unsupported(format!(
                    "https:// ({s}): this build of ferrum has no TLS support; set HF_ENDPOINT to an \
                     http:// mirror or download the files with another tool"
                )));
            }
            return Err(Error::msg(format!("not an http:// URL: '{s}'")));
        };
        let (authority, path) = match rest.find(['/', '?', '#']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let path = path.split('#').next().unwrap_or("/");
        let path = if path.starts_with('/') {
            path.to_string()
        } else {
            format!("/{path}")
        };
        let authority = authority.rsplit('@').next().unwrap_or(authority);
        let bad = || Error::msg(format!("bad host or port in URL '{s}'"));
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or_else(bad)?;
            let port = match rest.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad())?,
                None if rest.is_empty() => 80,
                None => return Err(bad()),
            };
            (h.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().map_err(|_| bad())?),
                None => (authority.to_string(), 80),
            }
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Url { host, port, path })
    }

    fn same_origin(&self, other: &Url) -> bool {
        self.host.eq_ignore_ascii_case(&other.host) && self.port == other.port
    }

    /// Resolves a `Location` header against this URL.
    fn join(&self, loc: &str) -> Result<Url> {
        if loc.contains("://") {
            return Url::parse(loc);
        }
        if let Some(rest) = loc.strip_prefix("//") {
            return Url::parse(&format!("http://{rest}"));
        }
        let joined = if loc.starts_with('/') {
            loc.to_string()
        } else {
            let base = self.path.split('?').next().unwrap_or("/");
            let dir = &base[..base.rfind('/').map_or(0, |i| i + 1)];
            format!("{dir}{loc}")
        };
        let (path, query) = match joined.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (joined.as_str(), None),
        };
        let mut path = remove_dot_segments(path);
        if let Some(q) = query {
            path = format!("{path}?{q}");
        }
        Ok(Url {
            path,
            ..self.clone()
        })
    }

    fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == 80 {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

impl std::fmt::Display for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.host_header(), self.path)
    }
}

/// A response whose body has not been read yet.
struct Response {
    status: u16,
    reason: String,
    /// Names lower-cased.
    headers: Vec<(String, String)>,
    body: BufReader<TcpStream>,
}

fn request(url: &Url, token: Option<&str>, timeout: Duration) -> Result<Response> {
    let net = |e: std::io::Error| Error::msg(format!("{url}: {e}"));
    let addrs: Vec<_> = std::net::ToSocketAddrs::to_socket_addrs(&(url.host.as_str(), url.port))
        .map_err(net)?
        .collect();
    let mut last = None;
    let mut stream = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = stream.ok_or_else(|| {
        net(last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "host has no address")
        }))
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(net)?;
    stream.set_write_timeout(Some(timeout)).map_err(net)?;
    let mut req = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: ferrum/{}\r\nAccept: */*\r\nAccept-Encoding: identity\r\nConnection: close\r\n",
        url.path,
        url.host_header(),
        env!("CARGO_PKG_VERSION")
    );
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).map_err(net)?;

    let mut body = BufReader::with_capacity(1 << 16, stream);
    let status_line = read_line(&mut body).map_err(net)?;
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let status = code
        .parse::<u16>()
        .ok()
        .filter(|_| version.starts_with("HTTP/"))
        .ok_or_else(|| Error::msg(format!("{url}: not an HTTP response: {status_line:?}")))?;
    let reason = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let line = read_line(&mut body).map_err(net)?;
        if line.is_empty() {
            break;
        }
        if headers.len() >= MAX_HEADERS {
            return Err(Error::msg(format!("{url}: too many response headers")));
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok(Response {
        status,
        reason,
        headers,
        body,
    })
}

/// One CRLF- (or LF-) terminated line, without the terminator; EOF before it is an error.
fn read_line(r: &mut BufReader<TcpStream>) -> std::io::Result<String> {
    let mut buf = Vec::new();
    r.by_ref()
        .take(MAX_HEADER_LINE)
        .read_until(b'\n', &mut buf)?;
    if buf.last() != Some(&b'\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed or line too long in the response head",
        ));
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The hub's `X-Error-Message`, formatted as a suffix.
    fn error_message(&self) -> String {
        self.header("x-error-message")
            .map(|m| format!(": {m}"))
            .unwrap_or_default()
    }

    /// Streams the body into `w` (Content-Length, chunked, or until the connection closes).
    fn copy_body(&mut self, w: &mut impl Write, url: &Url) -> Result<()> {
        let io = |e: std::io::Error| Error::msg(format!("{url}: download failed: {e}"));
        let chunked = self
            .header("transfer-encoding")
            .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
        if chunked {
            loop {
                let line = read_line(&mut self.body).map_err(io)?;
                let size = line.split(';').next().unwrap_or("").trim();
                let size = u64::from_str_radix(size, 16)
                    .map_err(|_| Error::msg(format!("{url}: bad chunk size line {line:?}")))?;
                if size == 0 {
                    // Trailer fields, up to the empty line (a missing one is tolerated).
                    while let Ok(l) = read_line(&mut self.body) {
                        if l.is_empty() {
                            break;
                        }
                    }
                    return Ok(());
                }
                copy_exact(&mut self.body, w, size, url)?;
                let end = read_line(&mut self.body).map_err(io)?;
                if !end.is_empty() {
                    return Err(Error::msg(format!("{url}: malformed chunked body")));
                }
            }
        }
        match self.header("content-length") {
            Some(n) => {
                let n: u64 = n
                    .parse()
                    .map_err(|_| Error::msg(format!("{url}: bad Content-Length {n:?}")))?;
                copy_exact(&mut self.body, w, n, url)
            }
            None => std::io::copy(&mut self.body, w).map(|_| ()).map_err(io),
        }
    }
}

/// Copies exactly `n` bytes; fewer (the connection closed early) is a truncated download.
fn copy_exact(r: &mut BufReader<TcpStream>, w: &mut impl Write, n: u64, url: &Url) -> Result<()> {
    let got = std::io::copy(&mut r.by_ref().take(n), w)
        .map_err(|e| Error::msg(format!("{url}: download failed: {e}")))?;
    if got != n {
        return Err(Error::msg(format!(
            "{url}: download truncated: got {got} of {n} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:8080/a/b?x=1").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 8080, "/a/b?x=1")
        );
        assert_eq!(Url::parse("http://hub").unwrap().to_string(), "http://hub/");
        assert_eq!(Url::parse("http://[::1]:9/x").unwrap().host, "::1");
        assert_eq!(u.join("/c").unwrap().to_string(), "http://127.0.0.1:8080/c");
        assert_eq!(
            u.join("c").unwrap().to_string(),
            "http://127.0.0.1:8080/a/c"
        );
        assert_eq!(u.join("../x/./y?q=../").unwrap().path, "/x/y?q=../");
        assert_eq!(u.join("/a/b/..").unwrap().path, "/a/");
        assert_eq!(u.join("../../..").unwrap().path, "/");
        assert_eq!(
            u.join("http://cdn:81/z").unwrap().to_string(),
            "http://cdn:81/z"
        );
        assert!(matches!(
            Url::parse("https://huggingface.co/x"),
            Err(Error::Unsupported(_))
        ));
        assert!(Url::parse("ftp://x").is_err());
        assert!(Url::parse("http://h:port/").is_err());
        let c = HubClient::new("http://h/");
        assert_eq!(
            c.file_url("org/m", "main", "a b.json"),
            "http://h/org/m/resolve/main/a%20b.json"
        );
        assert!(local_path(Path::new("/d"), "../x").is_err());
        assert!(local_path(Path::new("/d"), "/etc/x").is_err());
        assert_eq!(
            local_path(Path::new("/d"), "sub/x").unwrap(),
            Path::new("/d/sub/x")
        );
    }
}
