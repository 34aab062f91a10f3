//! Tests of `oxcomm::logging`: formulas, statistics, table layout, straggler view, JSON Lines,
//! configuration.

use std::collections::HashMap;
use std::panic::Location;

use oxcomm::logging::{
    algbw_gbps, bus_factor, convert_size, straggler_flatten, straggler_key_fingerprint, straggler_lengths,
    straggler_unflatten, trim_count, trimmed_mean, CommsLogger, LoggerConfig, OpKind, OpRecord, StragglerEntry,
    Summary, ENV_COMMS_LOGGER, ENV_COMMS_LOGGER_DEBUG, ENV_COMMS_LOGGER_PROF_OPS, ENV_COMMS_LOGGER_VERBOSE,
};
use oxcomm::{DType, ErrorKind};

fn rec(op: &'static str, bytes: u64, group_size: usize, latency_ns: u64) -> OpRecord {
    OpRecord {
        op,
        dtype: Some(DType::F32),
        count: (bytes / 4) as usize,
        bytes,
        group_size,
        seq: 0,
        algorithm: "ring",
        transport: "threads",
        start_ns: 0,
        latency_ns,
        caller: None,
    }
}

fn on() -> LoggerConfig {
    LoggerConfig { enabled: true, ..LoggerConfig::default() }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

#[track_caller]
fn here() -> &'static Location<'static> {
    Location::caller()
}

// ---- formulas ----------------------------------------------------------------------------

#[test]
fn bus_factor_per_op_and_group_size() {
    let two = |n: f64| 2.0 * (n - 1.0) / n;
    let nm1 = |n: f64| (n - 1.0) / n;
    let one = |_: f64| 1.0;
    let zero = |_: f64| 0.0;
    let cases: [(&str, &dyn Fn(f64) -> f64); 20] = [
        ("all_reduce", &two),
        ("onebit_all_reduce", &two),
        ("all_reduce_coalesced", &two),
        ("inference_all_reduce", &two),
        ("reduce_scatter", &nm1),
        ("reduce_scatter_tensor", &nm1),
        ("quant_reduce_scatter", &nm1),
        ("all_gather", &nm1),
        ("all_gather_into_tensor", &nm1),
        ("all_to_all", &nm1),
        ("all_to_all_v", &nm1),
        ("all_to_all_single", &nm1),
        ("gather", &nm1),
        ("scatter", &nm1),
        ("broadcast", &one),
        ("reduce", &one),
        ("send", &one),
        ("recv", &one),
        ("barrier", &zero),
        ("something_new", &one),
    ];
    for (op, f) in cases {
        for n in [1usize, 2, 4, 8] {
            let want = f(n as f64);
            assert!(close(bus_factor(op, n), want), "{op} n={n}: {} != {want}", bus_factor(op, n));
        }
    }
    // Spot values of the documented table.
    assert_eq!(bus_factor("all_reduce", 1), 0.0);
    assert_eq!(bus_factor("all_reduce", 4), 1.5);
    assert_eq!(bus_factor("all_gather", 8), 0.875);
    assert_eq!(bus_factor("reduce_scatter", 1), 0.0);
    assert_eq!(bus_factor("broadcast", 1), 1.0);
    assert_eq!(bus_factor("all_reduce", 0), 0.0);
}

#[test]
fn algbw_and_busbw_follow_nccl_tests() {
    // all_reduce: S/t; 1000 B in 1000 ns = 1 GB/s, busbw × 2(n−1)/n.
    let r = rec("all_reduce", 1000, 8, 1000);
    assert!(close(r.algbw_gbps(), 1.0));
    assert!(close(r.busbw_gbps(), 1.75));
    // all_gather records one rank's input: algbw counts the whole gathered array (S·n).
    let r = rec("all_gather", 1000, 4, 1000);
    assert!(close(r.algbw_gbps(), 4.0));
    assert!(close(r.busbw_gbps(), 3.0));
    // reduce_scatter records the full input already: no second × n (DeepSpeed's over-count).
    let r = rec("reduce_scatter", 4000, 4, 1000);
    assert!(close(r.algbw_gbps(), 4.0));
    assert!(close(r.busbw_gbps(), 3.0));
    let r = rec("quant_reduce_scatter", 4000, 4, 1000);
    assert!(close(r.busbw_gbps(), 3.0));
    // all_to_all: the whole send buffer.
    let r = rec("all_to_all", 4000, 4, 1000);
    assert!(close(r.algbw_gbps(), 4.0));
    assert!(close(r.busbw_gbps(), 3.0));
    // gather/scatter: per-rank buffer × n, (n−1)/n (nccl-tests gather.cu/scatter.cu).
    let r = rec("scatter", 1000, 2, 1000);
    assert!(close(r.algbw_gbps(), 2.0));
    assert!(close(r.busbw_gbps(), 1.0));
    // broadcast: S/t, factor 1, also on one rank.
    let r = rec("broadcast", 3000, 1, 1000);
    assert!(close(r.algbw_gbps(), 3.0));
    assert!(close(r.busbw_gbps(), 3.0));
    // barrier: no payload, factor 0.
    let r = rec("barrier", 0, 4, 1000);
    assert_eq!((r.algbw_gbps(), r.busbw_gbps()), (0.0, 0.0));
    // A zero latency gives 0, not infinity.
    assert_eq!(rec("all_reduce", 1000, 2, 0).algbw_gbps(), 0.0);
    assert_eq!(algbw_gbps("all_gather", 10, 0, 10), 1.0);
    assert_eq!(OpKind::of("irecv"), OpKind::PointToPoint);
}

// ---- statistics ---------------------------------------------------------------------------

#[test]
fn trim_count_matches_python_round_half_even() {
    // Python: int(round(n * 0.1)).
    for (len, k) in [
        (0, 0),
        (1, 0),
        (3, 0),
        (5, 0),
        (6, 1),
        (10, 1),
        (14, 1),
        (15, 2),
        (16, 2),
        (25, 2),
        (35, 4),
        (45, 4),
        (55, 6),
        (65, 6),
        (75, 8),
        (100, 10),
    ] {
        assert_eq!(trim_count(len, 0.1), k, "len {len}");
    }
    assert_eq!(trim_count(4, 0.9), 1, "capped so one value remains");
    assert_eq!(trim_count(10, f64::NAN), 0);
    assert_eq!(trim_count(10, -1.0), 0);
}

#[test]
fn trimmed_mean_drops_k_from_each_end_without_reordering() {
    let data = vec![3.0, 1.0, 2.0];
    assert_eq!(trimmed_mean(&data, 0.1), 2.0);
    assert_eq!(data, vec![3.0, 1.0, 2.0]);
    assert_eq!(trimmed_mean(&[], 0.1), 0.0);
    // len 15 → k = 2: the two outliers at each end go.
    let mut v: Vec<f64> = (1..=11).map(f64::from).collect();
    v.extend([1000.0, 2000.0, -1000.0, -2000.0]);
    assert_eq!(trimmed_mean(&v, 0.1), 6.0);
    // len 5 → k = 0: the outlier stays.
    assert_eq!(trimmed_mean(&[1.0, 1.0, 1.0, 1.0, 6.0], 0.1), 2.0);
    // len 25 → k = 2 (2.5 ties to even).
    let mut v = vec![10.0; 21];
    v.extend([0.0, 0.0, 100.0, 100.0]);
    assert_eq!(trimmed_mean(&v, 0.1), 10.0);
    let mut v = vec![10.0; 22];
    v.extend([0.0, 0.0, 0.0]);
    assert!(close(trimmed_mean(&v, 0.1), 200.0 / 21.0), "third 0 stays");
}

#[test]
fn convert_size_matches_deepspeed() {
    assert_eq!(convert_size(0), "0B");
    assert_eq!(convert_size(1), "1.0 B");
    assert_eq!(convert_size(1000), "1000.0 B");
    assert_eq!(convert_size(1024), "1.0 KB");
    assert_eq!(convert_size(2048), "2.0 KB");
    assert_eq!(convert_size(1152), "1.12 KB"); // 1.125 ties to even
    assert_eq!(convert_size(1536), "1.5 KB");
    assert_eq!(convert_size(711_837_040), "678.86 MB");
    for (k, unit) in ["KB", "MB", "GB", "TB", "PB", "EB"].iter().enumerate() {
        assert_eq!(convert_size(1u64 << (10 * (k + 1))), format!("1.0 {unit}"));
    }
    assert_eq!(convert_size(u64::MAX), "16.0 EB");
}

#[test]
fn summary_groups_by_op_then_size() {
    let recs = [
        rec("all_reduce", 64, 2, 2000),
        rec("barrier", 0, 2, 500),
        rec("all_reduce", 8, 2, 1000),
        rec("all_reduce", 64, 2, 4000),
    ];
    let s = Summary::from_records(&recs, false);
    let names: Vec<&str> = s.ops.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["all_reduce", "barrier"]);
    let sizes: Vec<u64> = s.ops[0].sizes.iter().map(|z| z.bytes).collect();
    assert_eq!(sizes, [8, 64]);
    let z = &s.ops[0].sizes[1];
    assert_eq!(z.count, 2);
    assert_eq!(z.latencies_ns, [2000, 4000]);
    assert!(close(z.total_latency_ms, 0.006));
    assert!(close(z.mean_latency_ms, 0.003));
    assert!(close(z.trimmed_latency_ms, 0.003));
    assert!(close(z.mean_algbw_gbps, (0.032 + 0.016) / 2.0));
    assert!(close(z.trimmed_busbw_gbps, (0.032 + 0.016) / 2.0));
    assert!(Summary::from_records(&[], false).is_empty());
}

#[test]
fn debug_mode_groups_by_call_site() {
    let a = here();
    let b = here();
    let mut r1 = rec("all_reduce", 8, 2, 10);
    r1.caller = Some(a);
    let mut r2 = r1;
    r2.caller = Some(b);
    let s = Summary::from_records(&[r1, r2, r1], true);
    assert_eq!(s.ops.len(), 2);
    assert_eq!(s.ops[0].name, format!("all_reduce | [Caller: {}:{}]", a.file(), a.line()));
    assert_eq!(s.ops[0].sizes[0].count, 2);
    let s = Summary::from_records(&[r1, r2, r1], false);
    assert_eq!(s.ops.len(), 1);
    assert_eq!(s.ops[0].sizes[0].count, 3);
}

#[test]
fn table_layout_golden() {
    let log = CommsLogger::new(on());
    log.record(rec("all_reduce", 1 << 20, 4, 1_000_000));
    log.record(rec("broadcast", 2048, 4, 1024));
    log.record(rec("all_reduce", 1 << 20, 4, 3_000_000));
    log.record(rec("all_reduce", 4, 4, 2000));
    let golden = concat!(
        "Comm. Op            Message Size        Count               Total Latency(ms)   Avg Latency(ms)     algbw_avg (GB/s)    busbw_avg (GB/s)    \n",
        "all_reduce\n",
        "                    4.0 B               1                   0.00                0.00                0.00                0.00                \n",
        "                    1.0 MB              2                   4.00                2.00                0.70                1.05                \n",
        "broadcast\n",
        "                    2.0 KB              1                   0.00                0.00                2.00                2.00                \n",
    );
    assert_eq!(log.summary().table(), golden);
}

// ---- straggler ----------------------------------------------------------------------------

const MS: u64 = 1_000_000;

#[test]
fn straggler_with_unequal_histories() {
    let log = CommsLogger::new(on());
    for lat in [10, 20, 30, 40] {
        log.record(rec("all_reduce", 1024, 2, lat * MS));
    }
    log.record(rec("send", 8, 2, MS)); // point-to-point: not in the straggler input
    log.record(rec("broadcast", 8, 2, MS));
    let input = log.straggler_input();
    let keys: Vec<(&str, u64, usize)> = input.iter().map(|(k, b, v)| (k.as_str(), *b, v.len())).collect();
    assert_eq!(keys, [("all_reduce", 1024, 4), ("broadcast", 8, 1)]);

    // The other rank logged only 3 all_reduces; the MIN history covers the common prefix.
    // broadcast is missing from the min input: it is left out of the breakdown.
    let min: Vec<StragglerEntry> = vec![("all_reduce".into(), 1024, vec![5 * MS, 20 * MS, 10 * MS])];
    let s = log.summary().with_straggler(&min);
    assert_eq!(s.ops.len(), 1);
    let row = &s.ops[0].sizes[0];
    assert_eq!(row.count, 3);
    assert!(close(row.total_comm_lat_ms, 35.0));
    assert!(close(row.total_straggler_ms, 25.0));
    assert!(close(row.avg_comm_lat_ms, 35.0 / 3.0));
    assert!(close(row.avg_straggler_ms, 25.0 / 3.0));
    let golden = concat!(
        "_______________________________\n",
        "Breakdown with straggler effect\n",
        "-------------------------------\n",
        "Comm. Op            Message Size        Count               Total comm lat(ms)  Total straggler(ms) Avg comm lat(ms)    Avg straggler(ms)   \n",
        "all_reduce\n",
        "                    1.0 KB              3                   35.00               25.00               11.67               8.33                \n",
    );
    assert_eq!(log.straggler_table(&min), golden);

    // A minimum above the local value (not a true MIN) saturates at 0 straggler.
    let bad: Vec<StragglerEntry> = vec![("all_reduce".into(), 1024, vec![50 * MS])];
    let row = &log.summary().with_straggler(&bad).ops[0].sizes[0];
    assert_eq!(row.total_straggler_ms, 0.0);
}

#[test]
fn straggler_protocol_across_two_simulated_ranks() {
    let r0 = CommsLogger::new(on());
    let r1 = CommsLogger::new(on());
    for lat in [4, 8, 6, 100] {
        r0.record(rec("all_gather", 256, 2, lat * MS));
    }
    for lat in [2, 9, 1] {
        r1.record(rec("all_gather", 256, 2, lat * MS));
    }
    for l in [&r0, &r1] {
        l.record(rec("barrier", 0, 2, MS));
    }
    let (in0, in1) = (r0.straggler_input(), r1.straggler_input());
    assert_eq!(straggler_key_fingerprint(&in0), straggler_key_fingerprint(&in1));
    // all-reduce MIN of the lengths, then of the flattened latencies.
    let lens: Vec<u64> =
        straggler_lengths(&in0).iter().zip(straggler_lengths(&in1)).map(|(a, b)| (*a).min(b)).collect();
    assert_eq!(lens, [3, 1]);
    let (f0, f1) = (straggler_flatten(&in0, &lens).unwrap(), straggler_flatten(&in1, &lens).unwrap());
    let fmin: Vec<u64> = f0.iter().zip(&f1).map(|(a, b)| *a.min(b)).collect();
    let min = straggler_unflatten(&in0, &lens, &fmin).unwrap();
    assert_eq!(min[0], ("all_gather".to_string(), 256, vec![2 * MS, 8 * MS, MS]));
    let s0 = r0.summary().with_straggler(&min);
    let ag = &s0.ops[0].sizes[0];
    assert_eq!(ag.count, 3);
    assert!(close(ag.total_comm_lat_ms, 11.0));
    assert!(close(ag.total_straggler_ms, 2.0 + 0.0 + 5.0));
    let s1 = r1.summary().with_straggler(&min);
    assert!(close(s1.ops[0].sizes[0].total_straggler_ms, 1.0));

    // Malformed buffers are errors, not panics.
    assert_eq!(straggler_flatten(&in0, &[3]).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert!(straggler_flatten(&in1, &[4, 1]).is_err());
    assert!(straggler_unflatten(&in0, &lens, &fmin[1..]).is_err());
}

// ---- logger -------------------------------------------------------------------------------

#[test]
fn prof_ops_filter_by_op_name() {
    let log = CommsLogger::new(LoggerConfig {
        enabled: true,
        prof_all: false,
        prof_ops: vec!["all_reduce".into(), "barrier".into()],
        ..LoggerConfig::default()
    });
    assert!(log.should_record("all_reduce"));
    assert!(log.should_record("barrier"));
    assert!(!log.should_record("all_gather"));
    assert!(!log.should_record("onebit_all_reduce"));
    let all = CommsLogger::new(on());
    assert!(all.should_record("anything"));
    let off = CommsLogger::default();
    assert!(!off.enabled());
    assert!(!off.should_record("all_reduce"));
    let off = CommsLogger::new(LoggerConfig { prof_ops: vec!["all_reduce".into()], ..LoggerConfig::default() });
    assert!(!off.should_record("all_reduce"), "disabled wins");
}

#[test]
fn records_reset_and_count() {
    let log = CommsLogger::new(on());
    log.reserve(10);
    assert_eq!(log.op_count(), 0);
    for i in 0..3000u64 {
        let mut r = rec("all_reduce", 8, 2, 10);
        r.seq = i;
        log.record(r);
    }
    assert_eq!(log.op_count(), 3000);
    let recs = log.records();
    assert!(recs.iter().enumerate().all(|(i, r)| r.seq == i as u64));
    log.reset();
    assert_eq!(log.op_count(), 0);
    assert!(log.records().is_empty());
    assert!(log.summary().is_empty());
    log.record(rec("barrier", 0, 2, 10));
    assert_eq!(log.records()[0].op, "barrier");
    let t0 = log.now_ns();
    assert!(log.now_ns() >= t0);
}

#[test]
fn logger_is_send_sync_and_records_from_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CommsLogger>();
    let log = CommsLogger::new(on());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let log = &log;
            s.spawn(move || {
                for i in 0..1000 {
                    let mut r = rec("all_reduce", 8, 4, 10);
                    r.seq = t * 1000 + i;
                    log.record(r);
                }
            });
        }
    });
    assert_eq!(log.op_count(), 4000);
    let mut seqs: Vec<u64> = log.records().iter().map(|r| r.seq).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (0..4000).collect::<Vec<_>>());
}

#[test]
fn verbose_record_does_not_panic_without_subscriber() {
    let log = CommsLogger::new(LoggerConfig { enabled: true, verbose: true, ..LoggerConfig::default() });
    log.record(rec("all_reduce", 1 << 20, 4, 250_000));
    assert_eq!(log.op_count(), 1);
}

// ---- JSON Lines ---------------------------------------------------------------------------

#[test]
fn jsonl_has_every_field() {
    let log = CommsLogger::new(on());
    let caller = here();
    log.record(OpRecord {
        op: "all_reduce",
        dtype: Some(DType::BF16),
        count: 524_288,
        bytes: 1_048_576,
        group_size: 4,
        seq: 17,
        algorithm: "ring",
        transport: "shm",
        start_ns: 1_520_000,
        latency_ns: 250_000,
        caller: Some(caller),
    });
    log.record(OpRecord {
        op: "barrier",
        dtype: None,
        count: 0,
        bytes: 0,
        group_size: 2,
        seq: 18,
        algorithm: "dissemination",
        transport: "tcp",
        start_ns: 2_000_000,
        latency_ns: 0,
        caller: None,
    });
    let mut out = Vec::new();
    log.write_jsonl(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert!(text.ends_with('\n'));

    let v: HashMap<String, serde_json::Value> = serde_json::from_str(lines[0]).unwrap();
    let mut keys: Vec<&str> = v.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "algbw_gbps",
            "algorithm",
            "busbw_gbps",
            "bytes",
            "caller",
            "count",
            "dtype",
            "group_size",
            "latency_ns",
            "op",
            "seq",
            "start_ns",
            "transport"
        ]
    );
    assert_eq!(v["op"], "all_reduce");
    assert_eq!(v["dtype"], "bf16");
    assert_eq!(v["count"], 524_288);
    assert_eq!(v["bytes"], 1_048_576);
    assert_eq!(v["group_size"], 4);
    assert_eq!(v["seq"], 17);
    assert_eq!(v["algorithm"], "ring");
    assert_eq!(v["transport"], "shm");
    assert_eq!(v["start_ns"], 1_520_000);
    assert_eq!(v["latency_ns"], 250_000);
    assert_eq!(v["algbw_gbps"], 4.194304);
    assert_eq!(v["busbw_gbps"], 6.291456);
    assert_eq!(v["caller"], format!("{}:{}", caller.file(), caller.line()).as_str());
    // Field order is the documented one.
    assert!(lines[0].starts_with(r#"{"op":"all_reduce","dtype":"bf16","count":524288,"bytes":1048576,"group_size":4,"seq":17,"algorithm":"ring","transport":"shm","start_ns":1520000,"latency_ns":250000,"algbw_gbps":4.194304,"busbw_gbps":6.291456,"caller":""#));

    let v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    assert!(v["dtype"].is_null());
    assert!(v["caller"].is_null());
    assert_eq!(v["algbw_gbps"], 0.0);
    assert_eq!(v["busbw_gbps"], 0.0);
}

#[test]
fn jsonl_write_error_is_an_io_error() {
    struct Broken;
    impl std::io::Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("disk full"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = CommsLogger::new(on());
    log.record(rec("all_reduce", 8, 2, 10));
    let e = log.write_jsonl(Broken).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert!(e.to_string().contains("disk full"), "{e}");
}

// ---- configuration ------------------------------------------------------------------------

fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
}

#[test]
fn config_from_lookup() {
    let c = LoggerConfig::from_lookup(lookup(&[])).unwrap();
    assert_eq!(c, LoggerConfig::default());
    assert!(!c.enabled);

    let c = LoggerConfig::from_lookup(lookup(&[(ENV_COMMS_LOGGER, "1")])).unwrap();
    assert!(c.enabled && c.prof_all && !c.verbose && !c.debug);
    assert!(c.prof_ops.is_empty());

    let c = LoggerConfig::from_lookup(lookup(&[
        (ENV_COMMS_LOGGER, "true"),
        (ENV_COMMS_LOGGER_VERBOSE, "ON"),
        (ENV_COMMS_LOGGER_DEBUG, "yes"),
        (ENV_COMMS_LOGGER_PROF_OPS, " all_reduce, barrier,,all_reduce "),
    ]))
    .unwrap();
    assert!(c.enabled && c.verbose && c.debug && !c.prof_all);
    assert_eq!(c.prof_ops, ["all_reduce", "barrier"]);
    assert!(c.should_record("barrier") && !c.should_record("all_gather"));

    // The sub-switches do nothing without the master switch.
    let c = LoggerConfig::from_lookup(lookup(&[(ENV_COMMS_LOGGER, "0"), (ENV_COMMS_LOGGER_PROF_OPS, "all_reduce")]))
        .unwrap();
    assert!(!c.enabled && !c.should_record("all_reduce"));

    let e = LoggerConfig::from_lookup(lookup(&[(ENV_COMMS_LOGGER_VERBOSE, "maybe")])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("OXCOMM_COMMS_LOGGER_VERBOSE"), "{e}");
    assert_eq!(ENV_COMMS_LOGGER, "OXCOMM_COMMS_LOGGER");
}
