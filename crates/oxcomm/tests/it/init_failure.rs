//! A rank that fails during `init()` (issue 16, item 5): the others must fail at once naming
//! it, not after the whole timeout; and a segment file left at a name an earlier run with the
//! same token would have used must not stop a new run. Ranks are real processes (this test
//! binary re-run as `init_failure::child_entry` by `harness::Job`) with a store served by the
//! parent.

use std::time::Duration;

use crate::harness::{self, Exit, Job, JobSpec};

/// Entry point of the child ranks; does nothing in a normal test run.
#[test]
fn child_entry() {
    if harness::role().is_none() {
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
        let Exit { code, out: text, secs } = &out[r];
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
