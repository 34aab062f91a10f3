//! A rank that fails during `init()` (issue 16, item 5): the others must fail at once naming
//! it, not after the whole timeout; and a segment file left at a name an earlier run with the
//! same token would have used must not stop a new run. Ranks are real processes (this test
//! binary re-run as `init_failure::child_entry`) with a store served by the parent.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxcomm::rendezvous::{self, Settings, StoreServer};

const CHILD: &str = "OXCOMM_TEST_INIT_CHILD";

/// Entry point of the child ranks; does nothing in a normal test run.
#[test]
fn child_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match oxcomm::init() {
        Ok(comm) => {
            comm.barrier().unwrap();
            println!("rank {} ok over {}", comm.rank(), comm.transport());
        }
        Err(e) => {
            eprintln!("init failed: {e}");
            std::process::exit(3);
        }
    }
}

struct Job {
    children: Vec<Child>,
    _server: StoreServer,
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `n` ranks of job `job_id` with `timeout_s`; rank `r` also gets `extra(r)`.
fn spawn(n: usize, job_id: &str, timeout_s: &str, extra: impl Fn(usize) -> Vec<(&'static str, String)>) -> Job {
    let token = rendezvous::generate_token();
    let token_bytes = Settings::from_lookup(|k| (k == "OXCOMM_TOKEN").then(|| token.clone())).unwrap().token.unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse::<SocketAddr>().unwrap(), &token_bytes).unwrap();
    let port = server.local_addr().port();
    let exe = std::env::current_exe().unwrap();
    let children = (0..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "init_failure::child_entry", "--nocapture", "--test-threads=1", "-q"])
                .env(CHILD, "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCOMM_TOKEN", &token)
                .env("OXCOMM_STORE", "launcher")
                .env("OXCOMM_JOB_ID", job_id)
                .env("OXCOMM_TIMEOUT", timeout_s)
                .env("OXCOMM_BIND", "none")
                .envs(extra(r))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    Job { children, _server: server }
}

/// (exit code, output, seconds from the start) per rank, or a panic at `deadline`.
fn wait_all(job: &mut Job, start: Instant, deadline: Instant) -> Vec<(Option<i32>, String, f64)> {
    let mut done: Vec<Option<(Option<i32>, f64)>> = vec![None; job.children.len()];
    while done.iter().any(Option::is_none) {
        for (r, c) in job.children.iter_mut().enumerate() {
            if done[r].is_none() {
                if let Some(status) = c.try_wait().unwrap() {
                    done[r] = Some((status.code(), start.elapsed().as_secs_f64()));
                }
            }
        }
        assert!(Instant::now() < deadline, "ranks still running at the deadline: {done:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    job.children
        .iter_mut()
        .zip(done)
        .map(|(c, d)| {
            let (code, secs) = d.unwrap();
            let mut s = String::new();
            c.stdout.take().unwrap().read_to_string(&mut s).unwrap();
            c.stderr.take().unwrap().read_to_string(&mut s).unwrap();
            (code, s, secs)
        })
        .collect()
}

fn leftovers(job: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(job))
                .collect()
        })
        .unwrap_or_default()
}

fn job_id(tag: &str) -> String {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!("i{}{tag}{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
}

/// Rank 1 of 3 gets `bad` (a setting that makes its init fail after the host exchange) and
/// everyone `common`; ranks 0 and 2 must fail naming rank 1 and its cause, long before the
/// 120 s timeout.
fn rank_1_fails(tag: &str, common: &[(&'static str, &str)], bad: (&'static str, &str)) {
    let job = job_id(tag);
    let start = Instant::now();
    let mut j = spawn(3, &job, "120", |r| {
        let mut env: Vec<(&'static str, String)> = common.iter().map(|(k, v)| (*k, v.to_string())).collect();
        if r == 1 {
            env.push((bad.0, bad.1.to_string()));
        }
        env
    });
    let out = wait_all(&mut j, start, start + Duration::from_secs(60));
    let (code, text, _) = &out[1];
    assert_eq!(*code, Some(3), "rank 1 should fail: {text}");
    assert!(text.contains(bad.0), "{text}");
    for r in [0, 2] {
        let (code, text, secs) = &out[r];
        assert_eq!(*code, Some(3), "rank {r} should fail: {text}");
        assert!(text.contains("rank 1 failed during init"), "rank {r}: {text}");
        assert!(text.contains(bad.0), "rank {r} should carry rank 1's cause: {text}");
        // Process start-up included; far below the 120 s timeout.
        assert!(*secs < 15.0, "rank {r} took {secs:.1} s");
    }
    assert!(leftovers(&job).is_empty(), "left in /dev/shm: {:?}", leftovers(&job));
}

#[test]
fn a_rank_that_fails_during_shm_init_is_named_by_the_others_at_once() {
    // Ranks 0 and 2 wait for rank 1's segment.
    rank_1_fails("shm", &[], ("OXCOMM_SHM_RING_BYTES", "lots"));
}

#[test]
fn a_rank_that_fails_during_tcp_init_is_named_by_the_others_at_once() {
    // Ranks 0 and 2 wait for rank 1's TCP address.
    rank_1_fails("tcp", &[("OXCOMM_TRANSPORT", "tcp")], ("OXCOMM_TCP_FRAME_BYTES", "lots"));
}

#[test]
fn a_segment_left_at_a_reused_tokens_old_name_does_not_stop_the_next_run() {
    let job = job_id("reuse");
    // The name rank 1's segment had when it was derived from the job (token) alone: a stale
    // file there (another user's, or a crashed run's) used to make rank 1 fail on every run.
    struct Removed(String);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let stale = Removed(format!("/dev/shm/oxcomm-{job}-0-1"));
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o000).open(&stale.0).unwrap();
    }
    let start = Instant::now();
    let mut j = spawn(2, &job, "60", |_| vec![]);
    let out = wait_all(&mut j, start, start + Duration::from_secs(60));
    drop(stale);
    for (r, (code, text, _)) in out.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r}: {text}");
        assert!(text.contains("ok over shm"), "rank {r}: {text}");
    }
    assert!(leftovers(&job).is_empty(), "left in /dev/shm: {:?}", leftovers(&job));
}
