//! Hub downloads against a local HTTP server: plain, chunked and close-delimited bodies, relative
//! and cross-host redirects (the token must not follow to another host), 404s, truncated bodies,
//! skipping files already present, and `download_model`'s optional files and shards.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ferrum_llm::hf::hub::HubClient;

/// What the canned server answers for a path.
#[derive(Clone)]
enum Reply {
    /// 200 with Content-Length.
    Body(Vec<u8>),
    /// 200 with Transfer-Encoding: chunked, in chunks of this size.
    Chunked(Vec<u8>, usize),
    /// 200 without a length: the body ends when the connection closes.
    UntilClose(Vec<u8>),
    /// A redirect with this status and Location.
    Redirect(u16, String),
    /// Content-Length promises more than is sent.
    Truncated(Vec<u8>, usize),
    /// 401 unless the request carries this bearer token.
    Private(String, Vec<u8>),
}

/// One request as the server saw it: path and Authorization header.
type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;

struct Server {
    port: u16,
    log: Log,
}

impl Server {
    fn start(routes: impl Fn(u16) -> HashMap<String, Reply>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = listener.local_addr().unwrap().port();
        let routes = routes(port);
        let log: Log = Arc::default();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = serve(stream, &routes, &log2);
            }
        });
        Server { port, log }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<(String, Option<String>)> {
        self.log.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, routes: &HashMap<String, Reply>, log: &Log) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut auth = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("authorization") {
                auth = Some(v.trim().to_string());
            }
        }
    }
    log.lock().unwrap().push((path.clone(), auth.clone()));
    let mut w = stream;
    let head = |status: &str, extra: &str| {
        format!("HTTP/1.1 {status}\r\n{extra}Connection: close\r\n\r\n")
    };
    match routes.get(&path) {
        None => {
            w.write_all(
                head(
                    "404 Not Found",
                    "X-Error-Message: Entry not found\r\nContent-Length: 0\r\n",
                )
                .as_bytes(),
            )?;
        }
        Some(Reply::Body(b)) => {
            w.write_all(head("200 OK", &format!("Content-Length: {}\r\n", b.len())).as_bytes())?;
            w.write_all(b)?;
        }
        Some(Reply::Chunked(b, size)) => {
            w.write_all(head("200 OK", "Transfer-Encoding: chunked\r\n").as_bytes())?;
            for c in b.chunks(*size) {
                write!(w, "{:x};ext=1\r\n", c.len())?;
                w.write_all(c)?;
                w.write_all(b"\r\n")?;
            }
            w.write_all(b"0\r\n\r\n")?;
        }
        Some(Reply::UntilClose(b)) => {
            w.write_all(head("200 OK", "").as_bytes())?;
            w.write_all(b)?;
        }
        Some(Reply::Redirect(code, to)) => {
            let status = format!("{code} Moved");
            w.write_all(
                head(&status, &format!("Location: {to}\r\nContent-Length: 0\r\n")).as_bytes(),
            )?;
        }
        Some(Reply::Truncated(b, claimed)) => {
            w.write_all(head("200 OK", &format!("Content-Length: {claimed}\r\n")).as_bytes())?;
            w.write_all(b)?;
        }
        Some(Reply::Private(token, b)) => {
            if auth.as_deref() == Some(&format!("Bearer {token}")) {
                w.write_all(
                    head("200 OK", &format!("Content-Length: {}\r\n", b.len())).as_bytes(),
                )?;
                w.write_all(b)?;
            } else {
                w.write_all(head("401 Unauthorized", "Content-Length: 0\r\n").as_bytes())?;
            }
        }
    }
    w.flush()
}

/// A scratch folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("ferrum-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn blob(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

const R: &str = "/org/tiny/resolve/main";

fn routes(port: u16) -> HashMap<String, Reply> {
    let mut m = HashMap::new();
    m.insert(
        format!("{R}/config.json"),
        Reply::Body(b"{\"model_type\": \"llama\"}".to_vec()),
    );
    // A cross-host redirect (localhost is another host name than 127.0.0.1) to a chunked body.
    m.insert(
        format!("{R}/model.safetensors"),
        Reply::Redirect(302, format!("http://localhost:{port}/cdn/blob-1")),
    );
    m.insert(
        "/cdn/blob-1".into(),
        Reply::Chunked(blob(300_000, 7), 65_000),
    );
    // A same-host relative redirect to a body that ends with the connection.
    m.insert(
        format!("{R}/tokenizer.json"),
        Reply::Redirect(307, "../raw/tok.json".into()),
    );
    m.insert(
        "/org/tiny/resolve/raw/tok.json".into(),
        Reply::UntilClose(b"{\"tok\": 1}".to_vec()),
    );
    m.insert(
        format!("{R}/sub/dir/notes.txt"),
        Reply::Body(b"nested".to_vec()),
    );
    m.insert(
        format!("{R}/broken.bin"),
        Reply::Truncated(blob(1000, 1), 5000),
    );
    m.insert(
        format!("{R}/loop"),
        Reply::Redirect(301, format!("{R}/loop")),
    );
    m.insert(
        "/org/private/resolve/main/config.json".into(),
        Reply::Private("hf_secret".into(), b"{}".to_vec()),
    );
    // A sharded model repo without tokenizer_config.json / chat_template.jinja.
    let sh = "/org/sharded/resolve/v1.0";
    m.insert(format!("{sh}/config.json"), Reply::Body(b"{}".to_vec()));
    m.insert(format!("{sh}/tokenizer.json"), Reply::Body(b"{}".to_vec()));
    m.insert(
        format!("{sh}/model.safetensors.index.json"),
        Reply::Body(br#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}"#.to_vec()),
    );
    m.insert(format!("{sh}/m-1.safetensors"), Reply::Body(blob(10, 1)));
    m.insert(
        format!("{sh}/m-2.safetensors"),
        Reply::Redirect(302, "/cdn/m-2".into()),
    );
    m.insert("/cdn/m-2".into(), Reply::Body(blob(20, 2)));
    m
}

#[test]
fn downloads_follow_redirects_and_guard_the_token() {
    let server = Server::start(routes);
    let dest = TempDir::new("hub-dl");
    let client = HubClient::new(server.endpoint()).with_token(Some("hf_secret".into()));
    let files = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "sub/dir/notes.txt",
    ];
    let got = client
        .download("org/tiny", "main", &files, &dest.0)
        .expect("download");
    assert_eq!(
        got,
        files.iter().map(|f| dest.0.join(f)).collect::<Vec<_>>()
    );
    assert_eq!(
        std::fs::read(&got[0]).unwrap(),
        b"{\"model_type\": \"llama\"}"
    );
    assert_eq!(std::fs::read(&got[1]).unwrap(), blob(300_000, 7));
    assert_eq!(std::fs::read(&got[2]).unwrap(), b"{\"tok\": 1}");
    assert_eq!(std::fs::read(&got[3]).unwrap(), b"nested");

    let log = server.requests();
    let auth_of = |p: &str| {
        log.iter()
            .find(|(q, _)| q == p)
            .unwrap_or_else(|| panic!("no request for {p}"))
            .1
            .clone()
    };
    let bearer = Some("Bearer hf_secret".to_string());
    assert_eq!(auth_of(&format!("{R}/config.json")), bearer);
    assert_eq!(
        auth_of("/org/tiny/resolve/raw/tok.json"),
        bearer,
        "same host keeps the token"
    );
    assert_eq!(
        auth_of("/cdn/blob-1"),
        None,
        "the token must not follow a redirect to another host"
    );

    // Present files are not fetched again.
    let n = log.len();
    client
        .download("org/tiny", "main", &files, &dest.0)
        .unwrap();
    assert_eq!(server.requests().len(), n);

    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dest.0)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".part"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn errors_are_clear() {
    let server = Server::start(routes);
    let dest = TempDir::new("hub-err");
    let client = HubClient::new(format!("{}/", server.endpoint()));
    let err = |files: &[&str]| {
        client
            .download("org/tiny", "main", files, &dest.0)
            .unwrap_err()
            .to_string()
    };

    let e = err(&["missing.bin"]);
    assert!(
        e.contains("file missing.bin not found in repo org/tiny"),
        "{e}"
    );
    let e = err(&["broken.bin"]);
    assert!(e.contains("truncated") && e.contains("1000 of 5000"), "{e}");
    let e = err(&["loop"]);
    assert!(e.contains("redirects"), "{e}");
    let e = err(&["../escape"]);
    assert!(e.contains("invalid repository file name"), "{e}");
    let e = client
        .download("org/private", "main", &["config.json"], &dest.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("401") && e.contains("HF_TOKEN"), "{e}");
    assert_eq!(
        std::fs::read_dir(&dest.0).unwrap().count(),
        0,
        "failed downloads leave nothing"
    );

    let authed = client.clone().with_token(Some("hf_secret".into()));
    authed
        .download("org/private", "main", &["config.json"], &dest.0)
        .expect("token opens the private repo");

    let e = HubClient::new("https://huggingface.co")
        .download("org/tiny", "main", &["model.safetensors"], &dest.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no TLS support"), "{e}");
    // Nothing listens on port 1: a connection error, not a hang or panic.
    let e = HubClient::new("http://127.0.0.1:1")
        .download("o/r", "main", &["x"], &dest.0)
        .unwrap_err();
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
}

#[test]
fn download_model_fetches_shards_and_skips_optional_files() {
    let server = Server::start(routes);
    let dest = TempDir::new("hub-model");
    let got = HubClient::new(server.endpoint())
        .download_model("org/sharded", "v1.0", &dest.0)
        .expect("download_model");
    let names: Vec<String> = got
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "config.json",
            "tokenizer.json",
            "model.safetensors.index.json",
            "m-1.safetensors",
            "m-2.safetensors"
        ]
    );
    assert_eq!(
        std::fs::read(dest.0.join("m-2.safetensors")).unwrap(),
        blob(20, 2)
    );
    assert!(!dest.0.join("tokenizer_config.json").exists());
}
