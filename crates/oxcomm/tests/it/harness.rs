//! The one multi-process harness of the integration tests. It owns starting processes, reading
//! their output, waiting for them with a deadline and killing them; it knows nothing about what
//! the processes check.
//!
//! - [`Proc`]: one process with its stdout and stderr read as they come (no full pipe ever
//!   blocks it), each line stamped with its arrival time; every wait has a deadline; dropping
//!   it SIGKILLs the process and everything below it, and the process gets SIGKILL by itself
//!   if the thread that started it dies first (`PR_SET_PDEATHSIG`).
//! - [`Job`]: ranks of one job as processes: this test binary re-run as one test function
//!   (`entry`, e.g. `faults::child_entry`) with its role in [`ROLE`] and the environment
//!   `oxcomm launch` would set (rank, world size, store address, token, job id, timeout), with
//!   a store served by the test itself. [`Job::wait_all`] collects each rank's exit and output;
//!   [`Job::leftovers`] lists what the job left in `/dev/shm`.
//!
//! The CLI tests (`oxcomm-cli/tests/cli/main.rs`) include this file by path and use [`Proc`]
//! for the `oxcomm` binary; [`Job`] is for ranks of this test binary.

#![allow(dead_code)] // The CLI tests use only part of it.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use oxcomm::rendezvous::{self, Settings, StoreServer};

/// The variable that names a child rank's role; a `child_entry` test without it does nothing.
pub const ROLE: &str = "OXCOMM_TEST_ROLE";

/// This process's role when it runs as a child rank, `None` in a normal test run.
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// The world communicator of a child rank ([`oxcomm::init`]); exits with code 3, saying why,
/// if it cannot be made.
pub fn init_child() -> oxcomm::Communicator {
    oxcomm::init().unwrap_or_else(|e| {
        eprintln!("init failed: {e}");
        std::process::exit(3)
    })
}

/// How long a finished process's output may still take to arrive (a grandchild can hold the
/// pipes open).
const DRAIN: Duration = Duration::from_secs(5);

/// How often waits look at the processes.
const POLL: Duration = Duration::from_millis(5);

// ---------------------------------------------------------------------------------------------
// One process
// ---------------------------------------------------------------------------------------------

/// Which pipe a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

/// One line of a process's output, with when it arrived.
#[derive(Debug, Clone)]
pub struct Line {
    pub at: Instant,
    pub stream: Stream,
    /// The line without its newline.
    pub text: String,
    /// Whether it ended with a newline (only the last line of a stream may not).
    pub ended: bool,
}

/// What a finished process left.
#[derive(Debug)]
pub struct Run {
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// From the start to when the exit was seen.
    pub elapsed: Duration,
}

/// A running process; see the module header.
pub struct Proc {
    child: Child,
    started: Instant,
    lines: mpsc::Receiver<Line>,
    seen: Vec<Line>,
    /// The exit code and when it was seen, once reaped.
    exit: Option<(Option<i32>, Instant)>,
}

impl Proc {
    /// Starts `command` with stdin closed and stdout and stderr read by the harness.
    pub fn spawn(mut command: Command) -> Proc {
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
        // which is async-signal-safe. The process then gets SIGKILL when the thread that
        // started it ends without dropping it (a test binary killed mid-test).
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let started = Instant::now();
        let (tx, lines) = mpsc::channel();
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().unwrap());
        for (pipe, stream) in [(out, Stream::Out), (err, Stream::Err)] {
            let tx = tx.clone();
            std::thread::spawn(move || pump(pipe, stream, tx));
        }
        Proc { child, started, lines, seen: Vec::new(), exit: None }
    }

    pub fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    /// Sends `signal` to the process (not after it was reaped: its pid may be reused).
    pub fn signal(&self, signal: libc::c_int) {
        assert!(self.exit.is_none(), "signal to a reaped process");
        // SAFETY: kill(2) on a child of ours that has not been reaped.
        unsafe { libc::kill(self.pid(), signal) };
    }

    /// The exit code once the process has exited (`Some(None)`: killed by a signal); does not
    /// block.
    pub fn try_exit(&mut self) -> Option<Option<i32>> {
        if self.exit.is_none() {
            if let Some(status) = self.child.try_wait().expect("waiting for a child") {
                self.exit = Some((status.code(), Instant::now()));
                self.drain();
            }
        }
        self.exit.map(|(code, _)| code)
    }

    /// Waits for the process to exit; fails the test (showing its output) after `limit`.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(code) = self.try_exit() {
                return code;
            }
            if Instant::now() >= deadline {
                panic!("pid {} still running after {limit:?}; output:\n{}", self.pid(), self.output());
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits for the process to exit and returns what it left; fails the test after `limit`.
    pub fn finish(mut self, limit: Duration) -> Run {
        let code = self.wait(limit);
        let elapsed = self.exit.map(|(_, at)| at - self.started).unwrap_or_default();
        Run { code, stdout: self.text(Some(Stream::Out)), stderr: self.text(Some(Stream::Err)), elapsed }
    }

    /// Waits until a line satisfies `pred` and returns it; fails the test after `limit`.
    pub fn wait_line(&mut self, limit: Duration, pred: impl Fn(&str) -> bool) -> Line {
        if let Some(line) = self.seen.iter().find(|l| pred(&l.text)) {
            return line.clone();
        }
        let deadline = Instant::now() + limit;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line.text) {
                        return line;
                    }
                }
                Err(_) => panic!("pid {}: no such line within {limit:?}; output:\n{}", self.pid(), self.output()),
            }
        }
    }

    /// The lines so far, both streams in arrival order.
    pub fn lines(&mut self) -> &[Line] {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }

    /// Both streams so far, one line each, in arrival order.
    pub fn output(&mut self) -> String {
        self.lines().iter().map(|l| format!("{}\n", l.text)).collect()
    }

    /// stdout followed by stderr, as written.
    pub fn stdout_then_stderr(&mut self) -> String {
        self.text(Some(Stream::Out)) + &self.text(Some(Stream::Err))
    }

    /// The direct children of the process.
    pub fn children(&self) -> Vec<libc::pid_t> {
        children(self.pid())
    }

    /// One stream (or both) so far, as written.
    fn text(&mut self, stream: Option<Stream>) -> String {
        let mine = |l: &&Line| stream.is_none_or(|s| l.stream == s);
        self.lines()
            .iter()
            .filter(mine)
            .map(|l| if l.ended { format!("{}\n", l.text) } else { l.text.clone() })
            .collect()
    }

    /// Reads what is left in the pipes once the process has exited.
    fn drain(&mut self) {
        let until = Instant::now() + DRAIN;
        while let Ok(line) = self.lines.recv_timeout(until.saturating_duration_since(Instant::now())) {
            self.seen.push(line);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exit.is_some() {
            return;
        }
        // The whole tree, found before anything dies: the process is not reaped yet, so the
        // pids below it cannot have been reused by unrelated processes.
        let mut all = vec![self.pid()];
        let mut i = 0;
        while i < all.len() {
            let below = children(all[i]);
            all.extend(below);
            i += 1;
        }
        for pid in all {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

/// Sends `pipe`'s lines to `tx` until the pipe closes.
fn pump(pipe: Box<dyn Read + Send>, stream: Stream, tx: mpsc::Sender<Line>) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let ended = buf.last() == Some(&b'\n');
                let text = String::from_utf8_lossy(&buf[..buf.len() - usize::from(ended)]).into_owned();
                if tx.send(Line { at: Instant::now(), stream, text, ended }).is_err() {
                    return;
                }
            }
        }
    }
}

/// The children of `parent`, from /proc.
pub fn children(parent: libc::pid_t) -> Vec<libc::pid_t> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<libc::pid_t>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        if rest.split_whitespace().nth(1).and_then(|p| p.parse::<libc::pid_t>().ok()) == Some(parent) {
            out.push(pid);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A job of ranks
// ---------------------------------------------------------------------------------------------

/// This test binary, set to run only the test function `entry` (e.g. `shm::child_process_role`).
pub fn child_command(entry: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary's path"));
    command.args(["--exact", entry, "--nocapture", "--test-threads=1", "-q"]);
    command
}

/// A job id unique to this test process: `{prefix}{pid}x{n}`.
pub fn job_id(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{prefix}{}x{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// What to start: see [`Job::of`].
pub struct JobSpec {
    entry: String,
    role: String,
    n: usize,
    job_id: String,
    env: Vec<(String, String)>,
    rank_env: Vec<(usize, String, String)>,
}

impl JobSpec {
    /// Sets `name` for every rank (over the job environment).
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// [`JobSpec::env`] for each pair.
    pub fn envs(self, pairs: &[(&str, &str)]) -> Self {
        pairs.iter().fold(self, |spec, (k, v)| spec.env(k, v))
    }

    /// Sets `name` for rank `rank` only (over everything else).
    pub fn rank_env(mut self, rank: usize, name: &str, value: &str) -> Self {
        self.rank_env.push((rank, name.to_owned(), value.to_owned()));
        self
    }

    /// Uses `id` as the job id instead of a fresh [`job_id`].
    pub fn job_id(mut self, id: &str) -> Self {
        id.clone_into(&mut self.job_id);
        self
    }

    /// Serves a store and starts the ranks.
    pub fn spawn(self) -> Job {
        let token = rendezvous::generate_token();
        let token_bytes =
            Settings::from_lookup(|k| (k == "OXCOMM_TOKEN").then(|| token.clone())).unwrap().token.unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse::<SocketAddr>().unwrap(), &token_bytes).unwrap();
        let port = server.local_addr().port().to_string();
        let n = self.n.to_string();
        let ranks = (0..self.n)
            .map(|r| {
                let rank = r.to_string();
                let mut command = child_command(&self.entry);
                command
                    .env(ROLE, &self.role)
                    .env("RANK", &rank)
                    .env("WORLD_SIZE", &n)
                    .env("LOCAL_RANK", &rank)
                    .env("LOCAL_WORLD_SIZE", &n)
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port)
                    .env("OXCOMM_TOKEN", &token)
                    .env("OXCOMM_STORE", "launcher")
                    .env("OXCOMM_JOB_ID", &self.job_id)
                    .envs(self.env.iter().map(|(k, v)| (k, v)))
                    .envs(self.rank_env.iter().filter(|(q, _, _)| *q == r).map(|(_, k, v)| (k, v)));
                Proc::spawn(command)
            })
            .collect();
        Job { ranks, job_id: self.job_id, _server: server }
    }
}

/// How one rank ended.
#[derive(Debug)]
pub struct Exit {
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// Its stdout followed by its stderr.
    pub out: String,
    /// From its start to when its exit was seen.
    pub secs: f64,
    /// When its exit was seen.
    pub at: Instant,
}

/// Ranks of one job as processes, with the store they meet at; dropping it kills every rank
/// still running.
pub struct Job {
    ranks: Vec<Proc>,
    pub job_id: String,
    _server: StoreServer,
}

impl Job {
    /// `n` ranks of this test binary running the test function `entry` as `role`, with the
    /// op timeout `timeout_s` (`OXCOMM_TIMEOUT`); add settings, then [`JobSpec::spawn`].
    pub fn of(entry: &str, role: &str, n: usize, timeout_s: &str) -> JobSpec {
        let spec = JobSpec {
            entry: entry.to_owned(),
            role: role.to_owned(),
            n,
            job_id: job_id("j"),
            env: Vec::new(),
            rank_env: Vec::new(),
        };
        spec.env("OXCOMM_TIMEOUT", timeout_s)
    }

    pub fn pid(&self, rank: usize) -> libc::pid_t {
        self.ranks[rank].pid()
    }

    /// Sends `signal` to rank `rank`.
    pub fn signal(&self, rank: usize, signal: libc::c_int) {
        self.ranks[rank].signal(signal);
    }

    /// Waits until rank `rank` prints a line that satisfies `pred` and returns it; fails the
    /// test after `limit`.
    pub fn wait_line(&mut self, rank: usize, limit: Duration, pred: impl Fn(&str) -> bool) -> Line {
        self.ranks[rank].wait_line(limit, pred)
    }

    /// Fails the test if a rank has exited.
    pub fn assert_running(&mut self) {
        for (r, p) in self.ranks.iter_mut().enumerate() {
            assert!(p.try_exit().is_none(), "rank {r} exited early:\n{}", p.stdout_then_stderr());
        }
    }

    /// Waits for every rank; fails the test after `limit`.
    pub fn wait_all(&mut self, limit: Duration) -> Vec<Exit> {
        let all: Vec<usize> = (0..self.ranks.len()).collect();
        self.wait_ranks(&all, limit)
    }

    /// Waits for the ranks `ranks` (the others may go on running); fails the test after
    /// `limit`.
    pub fn wait_ranks(&mut self, ranks: &[usize], limit: Duration) -> Vec<Exit> {
        let deadline = Instant::now() + limit;
        loop {
            let running: Vec<usize> = ranks.iter().copied().filter(|r| self.ranks[*r].try_exit().is_none()).collect();
            if running.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                panic!("ranks {running:?} still running after {limit:?}\n{}", self.outputs(ranks));
            }
            std::thread::sleep(POLL);
        }
        ranks
            .iter()
            .map(|r| {
                let p = &mut self.ranks[*r];
                let (code, at) = p.exit.expect("reaped above");
                Exit { code, out: p.stdout_then_stderr(), secs: (at - p.started).as_secs_f64(), at }
            })
            .collect()
    }

    /// Each of `ranks`' output so far, under a line saying whether it is still running or
    /// how it ended (for failure messages).
    fn outputs(&mut self, ranks: &[usize]) -> String {
        let mut text = String::new();
        for &r in ranks {
            let p = &mut self.ranks[r];
            let state = match p.try_exit() {
                None => "still running".to_string(),
                Some(Some(code)) => format!("exited with code {code}"),
                Some(None) => "killed by a signal".to_string(),
            };
            text += &format!("--- rank {r} ({state}):\n{}", p.output());
        }
        text
    }

    /// The files of this job in `/dev/shm`.
    pub fn leftovers(&self) -> Vec<String> {
        leftovers(&self.job_id)
    }

    /// Fails the test if the job left files in `/dev/shm`.
    pub fn assert_clean(&self) {
        let left = self.leftovers();
        assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
    }
}

/// The files in `/dev/shm` whose name holds `job`.
pub fn leftovers(job: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(job))
                .collect()
        })
        .unwrap_or_default()
}
