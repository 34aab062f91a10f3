//! `oxcomm plan`: a row per (hosts, size) with every algorithm's predicted time and the
//! planner's choice, the choice moving with the described links (issue 40), and one-line
//! errors for bad flags.

use std::time::Duration;

use crate::bench::oxcomm_within;

/// The data rows: (size, hosts, ranks, the four predicted times as printed, choice).
fn rows(stdout: &str) -> Vec<(u64, usize, usize, Vec<String>, String)> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().starts_with("size"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 8, "{l}");
            let times = f[3..7].iter().map(|s| s.to_string()).collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap(), times, f[7].to_string())
        })
        .collect()
}

#[test]
fn plan_prices_every_algorithm_and_names_the_choice() {
    let args = ["plan", "--hosts", "4,16", "--link", "1gbit", "--latency", "20us", "--size", "8,64K,64M"];
    let run = oxcomm_within(&args, Duration::from_secs(20));
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let table = rows(&run.stdout);
    assert_eq!(table.len(), 6, "{}", run.stdout);
    let choice = |hosts: usize, size: u64| table.iter().find(|r| r.1 == hosts && r.0 == size).unwrap().4.clone();
    assert_eq!(choice(4, 8), "rd");
    assert_eq!(choice(16, 64 << 10), "rhd");
    // Above 64 KiB the ring, as measured best (docs/perf_many_hosts.md).
    assert_eq!(choice(16, 64 << 20), "ring");
    // One rank per host: no hierarchical column value; the others are positive times.
    for (_, _, ranks, times, _) in &table {
        assert_eq!(times[3], "-");
        assert!(times[..3].iter().all(|t| t.parse::<f64>().unwrap() > 0.0), "{times:?}");
        assert!(*ranks == 4 || *ranks == 16);
    }
    // Several ranks per host: hierarchical is priced, and chosen for large buffers on a few
    // hosts (across many, the flat ring's link bytes are as few and it skips the local phases).
    let args =
        ["plan", "--hosts", "4", "--ranks-per-host", "8", "--link", "10gbit", "--latency", "25us", "--size", "64M"];
    let run = oxcomm_within(&args, Duration::from_secs(20));
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let big = rows(&run.stdout);
    assert_eq!(big[0].2, 32);
    assert_eq!(big[0].4, "hier", "{}", run.stdout);
}

#[test]
fn plan_rejects_bad_flags_in_one_line() {
    for args in [
        &["plan", "--hosts", "4", "--size", "8", "--link", "fast"][..],
        &["plan", "--hosts", "4", "--size", "8", "--latency", "soon"],
        &["plan", "--hosts", "0", "--size", "8"],
        &["plan", "--size", "8"],
        &["plan", "--hosts", "4", "--size", "8Q"],
    ] {
        let run = oxcomm_within(args, Duration::from_secs(20));
        assert!(matches!(run.code, Some(1) | Some(2)), "{args:?}: {:?} {}", run.code, run.stderr);
        assert_eq!(run.stderr.lines().count(), 1, "{args:?}: {}", run.stderr);
        assert!(run.stderr.starts_with("oxcomm: error: "), "{args:?}: {}", run.stderr);
    }
}
