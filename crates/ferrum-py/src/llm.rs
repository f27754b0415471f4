//! The LLM side: a model loaded once, generating through the server's engine (the continuous-
//! batching scheduler on its own thread), and its tokenizer. The Python layer
//! (`python/ferrum/llm.py`) gives these vLLM's shape (`LLM`, `SamplingParams`, `RequestOutput`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use ferrum_llm::{FinishReason, Llm, LoadOptions};
use ferrum_server::engine::{
    self, Completion, CompletionWait, EngineConfig, Event, Metrics, Request, TokenLogprobs,
};
use ferrum_tokenizer::{ChatTemplate, Tokenizer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::errors::{no_panic, FerrumError, InvalidArgument, NoSuchFile};

/// How often a wait for the engine wakes to let Python handle signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// One request's settings, read from a `SamplingParams` object.
struct Params {
    sampling: ferrum_llm::SamplingParams,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    ignore_eos: bool,
    min_tokens: usize,
    logprobs: Option<usize>,
    n: usize,
}

fn attr<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    p: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<T> {
    p.getattr(name)?.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyValueError::new_err(format!("SamplingParams.{name}: {e}"))
    })
}

fn read_params(p: &Bound<'_, PyAny>) -> PyResult<Params> {
    let top_k: i64 = attr(p, "top_k")?;
    let seed: Option<u64> = attr(p, "seed")?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let stop_obj = p.getattr("stop")?;
    let stop: Vec<String> = if stop_obj.is_none() {
        Vec::new()
    } else if let Ok(s) = stop_obj.extract::<String>() {
        vec![s]
    } else {
        attr(p, "stop")?
    };
    let sampling = ferrum_llm::SamplingParams {
        temperature: attr(p, "temperature")?,
        top_k: top_k.max(0) as usize,
        top_p: attr(p, "top_p")?,
        min_p: attr(p, "min_p")?,
        repeat_penalty: attr(p, "repetition_penalty")?,
        presence_penalty: attr(p, "presence_penalty")?,
        frequency_penalty: attr(p, "frequency_penalty")?,
        penalty_last_n: attr(p, "penalty_last_n")?,
        seed,
    };
    sampling.validate().map_err(PyValueError::new_err)?;
    let n: usize = attr(p, "n")?;
    if n == 0 {
        return Err(PyValueError::new_err("SamplingParams.n must be at least 1"));
    }
    let max_tokens: Option<usize> = attr(p, "max_tokens")?;
    if max_tokens == Some(0) {
        return Err(PyValueError::new_err(
            "SamplingParams.max_tokens must be at least 1",
        ));
    }
    Ok(Params {
        sampling,
        max_tokens,
        stop,
        ignore_eos: attr(p, "ignore_eos")?,
        min_tokens: attr(p, "min_tokens")?,
        logprobs: attr(p, "logprobs")?,
        n,
    })
}

/// What one request produced (built into `CompletionOutput` by the Python layer).
#[derive(Default)]
struct Collected {
    text: String,
    token_ids: Vec<u32>,
    /// Per generated token: (sampled token's logprob, its rank among `top` if there,
    /// top alternatives as (bytes, logprob)).
    logprobs: Vec<TokenLogprobs>,
    finish: Option<&'static str>,
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft: f64,
    error: Option<String>,
}

fn finish_name(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// The engine thread and the model it runs. Made by `ferrum.LLM`.
#[pyclass(module = "ferrum._ferrum", frozen)]
pub struct Engine {
    llm: Arc<Llm>,
    tx: Mutex<Option<Sender<Request>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    template: OnceLock<Result<ChatTemplate, String>>,
    /// Token bytes to ids, for the ids of logprob alternatives (built on first use).
    ids_by_bytes: OnceLock<HashMap<Vec<u8>, u32>>,
    ctx_size: usize,
    metrics: Arc<Metrics>,
}

impl Engine {
    fn template(&self) -> PyResult<&ChatTemplate> {
        self.template
            .get_or_init(|| self.llm.chat_template().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| FerrumError::new_err(format!("the model's chat template: {e}")))
    }

    fn sender(&self) -> PyResult<Sender<Request>> {
        self.tx
            .lock()
            .map_err(|_| FerrumError::new_err("the engine's lock is poisoned"))?
            .clone()
            .ok_or_else(|| FerrumError::new_err("the engine was shut down"))
    }

    /// Checks a prompt and picks its token budget, as the server does.
    fn budget(&self, prompt: &[u32], max_tokens: Option<usize>) -> PyResult<usize> {
        if prompt.is_empty() {
            return Err(InvalidArgument::new_err("the prompt is empty"));
        }
        let n_vocab = self.llm.model.config.n_vocab;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(InvalidArgument::new_err(format!(
                "token id {bad} is outside the vocabulary of {n_vocab}"
            )));
        }
        let room = self.ctx_size.saturating_sub(prompt.len());
        if room == 0 {
            return Err(InvalidArgument::new_err(format!(
                "the prompt has {} tokens; the context is {} tokens (ctx_size)",
                prompt.len(),
                self.ctx_size
            )));
        }
        match max_tokens {
            Some(m) if m > room => Err(InvalidArgument::new_err(format!(
                "prompt ({} tokens) + max_tokens ({m}) exceeds the context of {} tokens (ctx_size)",
                prompt.len(),
                self.ctx_size
            ))),
            Some(m) => Ok(m),
            None => Ok(room),
        }
    }

    fn ids_by_bytes(&self) -> &HashMap<Vec<u8>, u32> {
        self.ids_by_bytes.get_or_init(|| {
            let tok = &self.llm.tokenizer;
            let mut m = HashMap::with_capacity(tok.vocab_size());
            for id in (0..tok.vocab_size() as u32).rev() {
                // Lowest id wins where pieces share their bytes.
                m.insert(tok.token_bytes(id, false), id);
            }
            m
        })
    }

    /// Python form of one position's logprobs: `(sampled_logprob, [(id, bytes, logprob), ...])`.
    fn logprobs_py<'py>(&self, py: Python<'py>, lp: &TokenLogprobs) -> PyResult<Bound<'py, PyAny>> {
        let ids = self.ids_by_bytes();
        let top: Vec<Bound<'py, PyTuple>> = lp
            .top
            .iter()
            .map(|(b, l)| {
                let id = ids.get(b).map(|&i| i as i64).unwrap_or(-1);
                let text = String::from_utf8_lossy(b).into_owned();
                PyTuple::new(
                    py,
                    [
                        id.into_pyobject(py)?.into_any(),
                        text.into_pyobject(py)?.into_any(),
                        l.into_pyobject(py)?.into_any(),
                    ],
                )
            })
            .collect::<PyResult<_>>()?;
        Ok(PyTuple::new(
            py,
            [
                lp.logprob.into_pyobject(py)?.into_any(),
                String::from_utf8_lossy(&lp.token)
                    .into_owned()
                    .into_pyobject(py)?
                    .into_any(),
                PyList::new(py, top)?.into_any(),
            ],
        )?
        .into_any())
    }

    fn request(
        &self,
        prompt: Vec<u32>,
        p: &Params,
        max_tokens: usize,
        choice: usize,
        events: tokio::sync::mpsc::UnboundedSender<(usize, Event)>,
        seed_offset: u64,
    ) -> Request {
        let mut sampling = p.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(seed_offset);
        Request {
            prompt,
            max_tokens,
            sampling,
            stop: p.stop.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: p.min_tokens,
            priority: 0,
            logprobs: p.logprobs,
            choice,
            events,
            constraint: None,
            constraint_after: None,
            completion: None,
        }
    }
}

/// Waits for the next event with the GIL released, waking every [`SIGNAL_POLL`] to let Python
/// handle signals. `None`: the channel closed.
fn next_event(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    rx: &mut UnboundedReceiver<(usize, Event)>,
) -> PyResult<Option<(usize, Event)>> {
    loop {
        let got =
            py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_POLL, rx.recv()).await }));
        match got {
            Ok(ev) => return Ok(ev),
            Err(_) => py.check_signals()?,
        }
    }
}

/// Waits, with the GIL released, until the engine is through with every request of a
/// `generate` call, looking for signals every [`SIGNAL_POLL`].
///
/// `generate` needs its results only when they are complete, so it is woken once, when the
/// last request's [`Completion`] guard drops, not by each token's event: a wake-up per token
/// puts this thread on a core running the forward pass (a futex wake pulls the woken thread to
/// the waker's CPU, and with every core busy it preempts a kernel thread, stalling the others
/// at the next barrier), which cost decoding about 5% of its speed at one sequence.
fn wait_completion(py: Python<'_>, mut wait: CompletionWait) -> PyResult<()> {
    loop {
        // The wait moves to the detached closure and back (a receiver is not `Sync`).
        let (done, w) = py.detach(move || (wait.wait(SIGNAL_POLL), wait));
        if done {
            return Ok(());
        }
        wait = w;
        py.check_signals()?;
    }
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| FerrumError::new_err(format!("starting a timer runtime: {e}")))
}

#[pymethods]
impl Engine {
    /// Loads `model` (a GGUF file or a Hugging Face folder) and starts the engine thread.
    #[new]
    #[pyo3(signature = (model, n_threads, ctx_size, max_num_seqs, max_batch_tokens, kv_cache_memory, block_size, enable_prefix_caching, kv_cache_dtype))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        n_threads: Option<usize>,
        ctx_size: usize,
        max_num_seqs: usize,
        max_batch_tokens: usize,
        kv_cache_memory: Option<usize>,
        block_size: usize,
        enable_prefix_caching: bool,
        kv_cache_dtype: &str,
    ) -> PyResult<Self> {
        if n_threads == Some(0) {
            return Err(PyValueError::new_err("n_threads must be at least 1"));
        }
        if ctx_size == 0 || max_num_seqs == 0 || max_batch_tokens == 0 {
            return Err(PyValueError::new_err(
                "ctx_size, max_num_seqs and max_batch_tokens must be at least 1",
            ));
        }
        if !block_size.is_power_of_two() || block_size > 1024 {
            return Err(PyValueError::new_err(format!(
                "block_size {block_size} must be a power of two up to 1024"
            )));
        }
        let kv_type = ferrum_llm::model::kv_cache::KV_TYPES
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(kv_cache_dtype))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "unknown kv_cache_dtype '{kv_cache_dtype}' (f32, f16, q8_0, q4_0)"
                ))
            })?;
        if !model.exists() {
            return Err(NoSuchFile::new_err(format!(
                "{}: no such file or directory",
                model.display()
            )));
        }
        ferrum_kernels::pool::set_threads(n_threads);
        let opts = LoadOptions {
            dequantize: false,
            kv_type,
        };
        let loaded = py.detach(|| {
            no_panic_plain(|| Llm::load(&model, &opts, &mut |_, _| {}).map_err(|e| e.to_string()))
        });
        let llm = loaded
            .map_err(|e| FerrumError::new_err(format!("loading {}: {e}", model.display())))?;
        // The pool exactly as `ferrum serve` sizes it.
        let server_cfg = ferrum_server::ServerConfig {
            engine: EngineConfig {
                max_num_seqs,
                max_batch_tokens,
                ctx_size,
                prefix_caching: enable_prefix_caching,
            },
            kv_cache_memory,
            block_size,
            ..Default::default()
        };
        let pool = ferrum_server::kv_pool(&llm, &server_cfg)
            .map_err(|e| PyValueError::new_err(format!("{e:#}")))?;
        let llm = Arc::new(llm);
        let (tx, rx) = std::sync::mpsc::channel();
        let metrics = Arc::new(Metrics::default());
        let cfg = server_cfg.engine;
        let thread = {
            let llm = Arc::clone(&llm);
            let m = Arc::clone(&metrics);
            std::thread::Builder::new()
                .name("ferrum-engine".into())
                .spawn(move || engine::run(llm, cfg, pool, rx, m))
                .map_err(|e| FerrumError::new_err(format!("starting the engine thread: {e}")))?
        };
        Ok(Engine {
            llm,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            template: OnceLock::new(),
            ids_by_bytes: OnceLock::new(),
            ctx_size,
            metrics,
        })
    }

    /// The model's name (GGUF `general.name` or the file name).
    #[getter]
    fn name(&self) -> String {
        self.llm.name.clone()
    }

    /// The context size in tokens (prompt + completion of one request).
    #[getter]
    fn ctx_size(&self) -> usize {
        self.ctx_size
    }

    /// The tokenizer.
    #[getter]
    fn tokenizer(&self) -> PyTokenizer {
        PyTokenizer {
            tok: Arc::clone(&self.llm.tokenizer),
        }
    }

    /// Tokens of a text prompt, as the server's completions endpoint makes them (BOS added as
    /// the model wants it; special-token text is not parsed).
    fn encode_prompt(&self, text: &str) -> Vec<u32> {
        self.llm.tokenizer.encode(text, true, false)
    }

    /// Renders `messages_json` (a JSON list of messages) with the model's chat template as the
    /// server's chat endpoint does; returns the rendered text.
    #[pyo3(signature = (messages_json, add_generation_prompt, tools_json=None, kwargs_json=None))]
    fn render_chat(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        tools_json: Option<&str>,
        kwargs_json: Option<&str>,
    ) -> PyResult<String> {
        let template = self.template()?;
        let msgs = chat_messages(messages_json)?;
        let tools: Option<Box<serde_json::value::RawValue>> = match tools_json {
            Some(t) => Some(
                serde_json::from_str(t)
                    .map_err(|e| InvalidArgument::new_err(format!("tools: {e}")))?,
            ),
            None => None,
        };
        let kwargs: serde_json::Map<String, serde_json::Value> = match kwargs_json {
            Some(k) => serde_json::from_str(k).map_err(|e| {
                InvalidArgument::new_err(format!("chat_template_kwargs must be a dict: {e}"))
            })?,
            None => serde_json::Map::new(),
        };
        no_panic("rendering the chat template", || {
            template
                .render_json(&msgs, tools.as_deref(), &kwargs, add_generation_prompt)
                .map_err(|e| InvalidArgument::new_err(format!("chat template: {e}")))
        })
    }

    /// Tokens of a rendered chat (special tokens parsed; BOS unless the template wrote it).
    fn encode_chat(&self, rendered: &str) -> Vec<u32> {
        self.llm.encode_rendered_chat(rendered)
    }

    /// Runs every prompt (token ids) with its params as one continuous batch through the
    /// engine; returns, per prompt, a list of `n` result dicts.
    fn generate<'py>(
        &self,
        py: Python<'py>,
        prompts: Vec<Vec<u32>>,
        params: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Vec<Bound<'py, PyDict>>>> {
        if prompts.len() != params.len() {
            return Err(PyValueError::new_err(
                "one SamplingParams per prompt (or one for all)",
            ));
        }
        let params: Vec<Params> = params.iter().map(read_params).collect::<PyResult<_>>()?;
        let budgets: Vec<usize> = prompts
            .iter()
            .zip(&params)
            .map(|(pr, p)| self.budget(pr, p.max_tokens))
            .collect::<PyResult<_>>()?;
        let tx = self.sender()?;
        let (etx, mut erx) = unbounded_channel();
        let (completion, done) = Completion::group();
        // Choice index -> (prompt index, sample index).
        let mut slots: Vec<(usize, usize)> = Vec::new();
        for (i, (prompt, p)) in prompts.into_iter().zip(&params).enumerate() {
            for j in 0..p.n {
                let choice = slots.len();
                slots.push((i, j));
                let mut req =
                    self.request(prompt.clone(), p, budgets[i], choice, etx.clone(), j as u64);
                req.completion = Some(completion.clone());
                tx.send(req)
                    .map_err(|_| FerrumError::new_err("the engine thread has stopped"))?;
            }
        }
        drop(etx);
        drop(completion);
        wait_completion(py, done)?;
        // Every request is dropped, so every event it sent is in the channel.
        let mut got: Vec<Collected> = (0..slots.len()).map(|_| Collected::default()).collect();
        let mut left = slots.len();
        while let Ok((c, ev)) = erx.try_recv() {
            let Some(out) = got.get_mut(c) else { continue };
            match ev {
                Event::Token {
                    text,
                    logprobs,
                    token,
                } => {
                    out.text.push_str(&text);
                    out.token_ids.extend(token);
                    out.logprobs.extend(logprobs);
                }
                Event::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    ttft,
                    ..
                } => {
                    out.finish = Some(finish_name(finish));
                    out.prompt_tokens = prompt_tokens;
                    out.cached_tokens = cached_tokens;
                    out.ttft = ttft;
                    left -= 1;
                }
                Event::Error(e) => {
                    out.error = Some(e);
                    left -= 1;
                }
            }
        }
        if let Some(e) = got.iter().find_map(|g| g.error.as_ref()) {
            return Err(FerrumError::new_err(format!("generation failed: {e}")));
        }
        if left > 0 {
            return Err(FerrumError::new_err(
                "the engine stopped before the requests finished",
            ));
        }
        let n_prompts = params.len();
        let mut res: Vec<Vec<Bound<'py, PyDict>>> = (0..n_prompts).map(|_| Vec::new()).collect();
        for (c, g) in got.into_iter().enumerate() {
            let d = PyDict::new(py);
            d.set_item("index", slots[c].1)?;
            d.set_item("text", &g.text)?;
            d.set_item("token_ids", &g.token_ids)?;
            d.set_item("finish_reason", g.finish)?;
            d.set_item("prompt_tokens", g.prompt_tokens)?;
            d.set_item("cached_tokens", g.cached_tokens)?;
            d.set_item("ttft", g.ttft)?;
            if params[slots[c].0].logprobs.is_some() {
                let lps: Vec<Bound<'py, PyAny>> = g
                    .logprobs
                    .iter()
                    .map(|l| self.logprobs_py(py, l))
                    .collect::<PyResult<_>>()?;
                d.set_item("logprobs", lps)?;
            } else {
                d.set_item("logprobs", py.None())?;
            }
            res[slots[c].0].push(d);
        }
        Ok(res)
    }

    /// Submits one prompt and returns a stream of its events.
    fn stream(&self, prompt: Vec<u32>, params: &Bound<'_, PyAny>) -> PyResult<TokenStream> {
        let p = read_params(params)?;
        if p.n != 1 {
            return Err(PyValueError::new_err(
                "streaming takes SamplingParams.n == 1",
            ));
        }
        let budget = self.budget(&prompt, p.max_tokens)?;
        let (etx, erx) = unbounded_channel();
        let req = self.request(prompt, &p, budget, 0, etx, 0);
        self.sender()?
            .send(req)
            .map_err(|_| FerrumError::new_err("the engine thread has stopped"))?;
        Ok(TokenStream {
            rx: Mutex::new(Some(erx)),
            rt: runtime()?,
            want_logprobs: p.logprobs.is_some(),
        })
    }

    /// Logprob tuples for a stream's token event (see `logprobs_py`).
    fn _logprobs_of(&self, py: Python<'_>, raw: &Bound<'_, RawLogprobs>) -> PyResult<Py<PyAny>> {
        Ok(self.logprobs_py(py, &raw.get().0)?.unbind())
    }

    /// Engine counters: requests running and waiting, KV blocks in use, tokens in and out.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let m = &self.metrics;
        let d = PyDict::new(py);
        d.set_item("num_requests_running", m.running.load(Relaxed))?;
        d.set_item("num_requests_waiting", m.waiting.load(Relaxed))?;
        d.set_item("prompt_tokens_total", m.prompt_tokens.load(Relaxed))?;
        d.set_item("generation_tokens_total", m.generation_tokens.load(Relaxed))?;
        Ok(d)
    }

    /// Stops the engine thread once the requests it holds have finished (idempotent).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        let handle = self.thread.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            py.detach(|| h.join())
                .map_err(|_| FerrumError::new_err("the engine thread panicked"))?;
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Some(h) = self.thread.lock().ok().and_then(|mut h| h.take()) {
            let _ = h.join();
        }
    }
}

/// A panic in `f` as an error string.
fn no_panic_plain<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(format!(
            "internal error: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into())
        ))
    })
}

/// A generated token's log-probabilities, held for the Python layer.
#[pyclass(module = "ferrum._ferrum", frozen)]
pub struct RawLogprobs(TokenLogprobs);

/// The events of one streamed request. Iterating gives `("token", text, token_id, logprobs)`
/// and finally `("done", finish_reason, prompt_tokens, completion_tokens)`; dropping it
/// cancels the request.
#[pyclass(module = "ferrum._ferrum", frozen)]
pub struct TokenStream {
    rx: Mutex<Option<UnboundedReceiver<(usize, Event)>>>,
    rt: tokio::runtime::Runtime,
    want_logprobs: bool,
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next event (see the class); `StopIteration` after the last.
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let mut guard = self
            .rx
            .lock()
            .map_err(|_| FerrumError::new_err("the stream's lock is poisoned"))?;
        let Some(rx) = guard.as_mut() else {
            return Ok(None);
        };
        let ev = next_event(py, &self.rt, rx)?;
        let out = match ev {
            None => {
                *guard = None;
                return Err(FerrumError::new_err("the engine dropped the request"));
            }
            Some((
                _,
                Event::Token {
                    text,
                    logprobs,
                    token,
                },
            )) => {
                let lp: Py<PyAny> = match logprobs.filter(|_| self.want_logprobs) {
                    Some(l) => Py::new(py, RawLogprobs(l))?.into_any(),
                    None => py.None(),
                };
                PyTuple::new(
                    py,
                    [
                        "token".into_pyobject(py)?.into_any(),
                        text.into_pyobject(py)?.into_any(),
                        token.into_pyobject(py)?.into_any(),
                        lp.into_bound(py),
                    ],
                )?
            }
            Some((
                _,
                Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                },
            )) => {
                *guard = None;
                PyTuple::new(
                    py,
                    [
                        "done".into_pyobject(py)?.into_any(),
                        finish_name(finish).into_pyobject(py)?.into_any(),
                        prompt_tokens.into_pyobject(py)?.into_any(),
                        completion_tokens.into_pyobject(py)?.into_any(),
                    ],
                )?
            }
            Some((_, Event::Error(e))) => {
                *guard = None;
                return Err(FerrumError::new_err(format!("generation failed: {e}")));
            }
        };
        Ok(Some(out))
    }

    /// Cancels the request (the engine frees its KV blocks at its next step).
    fn close(&self) {
        if let Ok(mut g) = self.rx.lock() {
            g.take();
        }
    }
}

/// Chat messages from JSON, as the server's chat endpoint reads them: `role` (`developer` is
/// taken as `system`), `content` as text or a list of text parts (null for an assistant turn
/// that only calls tools), and `tool_calls`, `tool_call_id`, `name` passed on.
fn chat_messages(json: &str) -> PyResult<Vec<serde_json::Value>> {
    use serde_json::Value as J;
    let bad = |m: String| InvalidArgument::new_err(m);
    let msgs: Vec<J> = serde_json::from_str(json)
        .map_err(|e| bad(format!("messages must be a list of dicts: {e}")))?;
    if msgs.is_empty() {
        return Err(bad("messages is empty".into()));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (at, m) in msgs.into_iter().enumerate() {
        let J::Object(m) = m else {
            return Err(bad(format!("messages[{at}] is not a dict")));
        };
        let role = match m.get("role").and_then(J::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r.to_string(),
            Some("developer") => "system".to_string(),
            Some(other) => {
                return Err(bad(format!(
                    "messages[{at}]: unknown role '{other}' \
                     (system, developer, user, assistant, tool)"
                )))
            }
            None => return Err(bad(format!("messages[{at}] has no role"))),
        };
        let content = match m.get("content") {
            Some(J::String(s)) => s.clone(),
            Some(J::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.get("type").and_then(J::as_str), p.get("text").and_then(J::as_str)) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        (k, _) => {
                            return Err(bad(format!(
                                "messages[{at}]: content parts of type '{}' are not supported (only text)",
                                k.unwrap_or("?")
                            )))
                        }
                    }
                }
                s
            }
            None | Some(J::Null) if role == "assistant" => String::new(),
            _ => return Err(bad(format!("messages[{at}] ({role}) has no text content"))),
        };
        let mut o = serde_json::Map::new();
        o.insert("role".into(), J::String(role));
        o.insert("content".into(), J::String(content));
        for k in ["tool_calls", "tool_call_id", "name"] {
            if let Some(v) = m.get(k).filter(|v| !v.is_null()) {
                o.insert(k.into(), v.clone());
            }
        }
        out.push(J::Object(o));
    }
    Ok(out)
}

/// The model's tokenizer (`llm.tokenizer` / `llm.get_tokenizer()`).
#[pyclass(module = "ferrum", name = "Tokenizer", frozen)]
pub struct PyTokenizer {
    tok: Arc<Tokenizer>,
}

#[pymethods]
impl PyTokenizer {
    /// Token ids of `text`. `add_special_tokens`: add BOS/EOS as the model asks;
    /// `parse_special`: read special-token text such as `<|im_start|>` as those tokens.
    #[pyo3(signature = (text, add_special_tokens=true, parse_special=false))]
    fn encode(
        &self,
        py: Python<'_>,
        text: &str,
        add_special_tokens: bool,
        parse_special: bool,
    ) -> Vec<u32> {
        let tok = &self.tok;
        py.detach(|| tok.encode(text, add_special_tokens, parse_special))
    }

    /// The text of `token_ids`. `skip_special_tokens`: leave out control tokens' text.
    #[pyo3(signature = (token_ids, skip_special_tokens=true))]
    fn decode(&self, token_ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        let n = self.tok.vocab_size();
        let ids = token_ids
            .iter()
            .map(|&t| {
                if t < 0 || t as usize >= n {
                    Err(InvalidArgument::new_err(format!(
                        "token id {t} is outside the vocabulary of {n}"
                    )))
                } else {
                    Ok(t as u32)
                }
            })
            .collect::<PyResult<Vec<u32>>>()?;
        Ok(self.tok.decode(&ids, !skip_special_tokens))
    }

    /// The vocabulary's text form of one token (e.g. `Ġthe` for byte-level BPE).
    fn convert_ids_to_tokens(&self, token_ids: Vec<u32>) -> PyResult<Vec<String>> {
        let n = self.tok.vocab_size();
        token_ids
            .iter()
            .map(|&t| {
                if t as usize >= n {
                    Err(InvalidArgument::new_err(format!(
                        "token id {t} is outside the vocabulary of {n}"
                    )))
                } else {
                    Ok(self.tok.token_text(t).to_string())
                }
            })
            .collect()
    }

    /// Number of tokens in the vocabulary.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.tok.vocab_size()
    }

    /// The beginning-of-sequence token id, if the model has one.
    #[getter]
    fn bos_token_id(&self) -> Option<u32> {
        self.tok.bos()
    }

    /// The end-of-sequence token id, if the model has one.
    #[getter]
    fn eos_token_id(&self) -> Option<u32> {
        self.tok.eos()
    }

    /// Every token id that ends a generation.
    #[getter]
    fn eog_token_ids(&self) -> Vec<u32> {
        self.tok.eog_ids()
    }

    fn __len__(&self) -> usize {
        self.tok.vocab_size()
    }
}
