//! A rank that fails during `init()` (issue 16, item 5): the others must fail at once naming
//! it, not after the whole timeout; so must a rank killed right after it published its
//! segment or listener address (issue 28, item 8; not yet over TCP); and a segment file left
//! at a name an earlier run with the same token would have used must not stop a new run. Ranks
//! are real processes (this test binary re-run as `init_failure::child_entry` by
//! `harness::Job`) with a store served by the parent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oxcomm::rendezvous::{Store, StoreClient};
use oxcomm::Init;

use crate::harness::{self, Exit, Job, JobSpec};

/// Entry point of the child ranks; does nothing in a normal test run.
#[test]
fn child_entry() {
    let Some(role) = harness::role() else { return };
    if role == "dies_after_publishing" && std::env::var("RANK").as_deref() == Ok("1") {
        die_after_publishing();
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

/// The store key (under the job's prefix) that, once rank 1 has set it, tells the others
/// where to find its segment or listener.
const PUBLISHED: &str = "OXCOMM_TEST_PUBLISHED";

/// Rank 1 of role `dies_after_publishing`: joins as `oxcomm::init` would (same job id), through
/// a store that SIGKILLs this process right after it sets the key ending in [`PUBLISHED`].
fn die_after_publishing() -> ! {
    struct DieAfter(StoreClient, String);
    impl Store for DieAfter {
        fn set(&self, key: &str, value: &[u8]) -> oxcomm::Result<()> {
            self.0.set(key, value)?;
            if key.ends_with(&self.1) {
                // SAFETY: kill(2) on this process; it does not return.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            Ok(())
        }
        fn get(&self, key: &str, deadline: Instant) -> oxcomm::Result<Vec<u8>> {
            self.0.get(key, deadline)
        }
        fn try_get(&self, key: &str) -> oxcomm::Result<Option<Vec<u8>>> {
            self.0.try_get(key)
        }
        fn wait(&self, keys: &[&str], deadline: Instant) -> oxcomm::Result<()> {
            self.0.wait(keys, deadline)
        }
        fn add(&self, key: &str, delta: i64) -> oxcomm::Result<i64> {
            self.0.add(key, delta)
        }
        fn delete(&self, key: &str) -> oxcomm::Result<bool> {
            self.0.delete(key)
        }
        fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> oxcomm::Result<Vec<u8>> {
            self.0.compare_set(key, expected, new)
        }
    }
    let mut init = Init::from_env().unwrap();
    // `oxcomm::init` joins as the process's first communicator, `<job>-0`.
    init.job = format!("{}-0", init.job);
    let client = StoreClient::connect(init.store_addr, &init.token, Instant::now() + init.config.timeout).unwrap();
    let key = std::env::var(PUBLISHED).unwrap();
    let r = init.connect_with_store(Arc::new(DieAfter(client, key)));
    eprintln!("rank 1 was not killed after publishing: {:?}", r.err());
    std::process::exit(4)
}

/// `n` ranks of job `job_id` with `timeout_s`, not bound to cores.
fn spec(n: usize, job_id: &str, timeout_s: &str) -> JobSpec {
    Job::of("init_failure::child_entry", "init", n, timeout_s).job_id(job_id).env("OXCOMM_BIND", "none")
}

/// The longest a job of these tests may run.
const LIMIT: Duration = Duration::from_secs(60);

/// Rank 1 of 3 gets `bad` (a setting that makes its init fail after the host exchange) and
/// everyone `common`; ranks 0 and 2 must fail naming rank 1 and its cause, long before the
/// 120 s timeout.
fn rank_1_fails(tag: &str, common: &[(&'static str, &str)], bad: (&'static str, &str)) {
    let job = harness::job_id(&format!("i{tag}"));
    let mut j = spec(3, &job, "120").envs(common).rank_env(1, bad.0, bad.1).spawn();
    let out = j.wait_all(LIMIT);
    let Exit { code, out: text, .. } = &out[1];
    assert_eq!(*code, Some(3), "rank 1 should fail: {text}");
    assert!(text.contains(bad.0), "{text}");
    for r in [0, 2] {
        let Exit { code, out: text, secs, .. } = &out[r];
        assert_eq!(*code, Some(3), "rank {r} should fail: {text}");
        assert!(text.contains("rank 1 failed during init"), "rank {r}: {text}");
        assert!(text.contains(bad.0), "rank {r} should carry rank 1's cause: {text}");
        // Process start-up included; far below the 120 s timeout.
        assert!(*secs < 15.0, "rank {r} took {secs:.1} s");
    }
    assert!(j.leftovers().is_empty(), "left in /dev/shm: {:?}", j.leftovers());
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
    let job = harness::job_id("ireuse");
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
    let mut j = spec(2, &job, "60").spawn();
    let out = j.wait_all(LIMIT);
    drop(stale);
    for (r, Exit { code, out: text, .. }) in out.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r}: {text}");
        assert!(text.contains("ok over shm"), "rank {r}: {text}");
    }
    assert!(j.leftovers().is_empty(), "left in /dev/shm: {:?}", j.leftovers());
}

/// Issue 28, item 8: rank 1 of 3 publishes where to reach it (the store key ending in
/// `published`) and is killed; ranks 0 and 2, attaching to its segment or connecting to its
/// listener, must fail naming it within 2 s of its death, not at the 120 s deadline.
fn rank_1_dies_after_publishing(tag: &str, published: &str, env: &[(&str, &str)]) {
    let job = harness::job_id(&format!("i{tag}"));
    let mut j = Job::of("init_failure::child_entry", "dies_after_publishing", 3, "120")
        .job_id(&job)
        .env("OXCOMM_BIND", "none")
        .env(PUBLISHED, published)
        .envs(env)
        .spawn();
    let out = j.wait_all(LIMIT);
    assert_eq!(out[1].code, None, "rank 1 was not killed: {}", out[1].out);
    for r in [0, 2] {
        let Exit { code, out: text, at, .. } = &out[r];
        assert_eq!(*code, Some(3), "rank {r} should fail: {text}");
        assert!(text.contains("rank 1"), "rank {r} does not name rank 1: {text}");
        let after = at.saturating_duration_since(out[1].at);
        assert!(after < Duration::from_secs(2), "rank {r} failed {after:?} after rank 1 died: {text}");
    }
    // Rank 1's segment stays only if nobody had attached it when it died (its name is then
    // a stale one, rejected by a later attach); the survivors' are gone.
    let stale = "-1";
    let left = j.leftovers();
    for name in &left {
        let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
    }
    assert!(left.iter().all(|n| n.ends_with(stale)), "left in /dev/shm: {left:?}");
}

#[test]
fn a_rank_that_dies_after_publishing_its_segment_is_named_within_2s() {
    rank_1_dies_after_publishing("shmdead", "shm/1", &[]);
}

#[test]
fn a_rank_that_dies_after_publishing_its_tcp_address_is_named_within_2s() {
    rank_1_dies_after_publishing("tcpdead", "addr/1", &[("OXCOMM_TRANSPORT", "tcp")]);
}
