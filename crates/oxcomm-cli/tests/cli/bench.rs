//! `oxcomm bench`: the table (a row per op and size, nothing wrong) over threads and over
//! shared-memory processes, the JSON and CSV files, and one-line errors for bad flags. Every
//! run has a deadline and is killed when it overruns.

use std::process::Command;
use std::time::Duration;

use crate::harness::{Proc, Run};

const OXCOMM: &str = env!("CARGO_BIN_EXE_oxcomm");

/// Longest any bench run in these tests may take.
const LIMIT: Duration = Duration::from_secs(60);

/// The ten ops of `--op all` (f32), in their order.
const OPS: [&str; 10] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "onebit_all_reduce",
    "quant_reduce_scatter",
];

/// Runs `oxcomm ARGS`; kills it and fails the test after [`LIMIT`].
fn oxcomm(args: &[&str]) -> Run {
    oxcomm_within(args, LIMIT)
}

/// Runs `oxcomm ARGS`; kills it and fails the test after `limit`.
pub(crate) fn oxcomm_within(args: &[&str], limit: Duration) -> Run {
    let mut command = Command::new(OXCOMM);
    command.args(args);
    Proc::spawn(command).finish(limit)
}

/// One data row of the table.
#[derive(Debug)]
struct Row {
    size: u64,
    redop: String,
    wrong_oop: String,
    wrong_ip: String,
    wire: u64,
}

/// The rows of each op's block, in order: (op, rows).
fn blocks(stdout: &str) -> Vec<(String, Vec<Row>)> {
    let mut out: Vec<(String, Vec<Row>)> = Vec::new();
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("# Collective: ") {
            out.push((rest.split_whitespace().next().unwrap().to_string(), Vec::new()));
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 16, "a row has 16 columns: {line:?}");
        let row = Row {
            size: f[0].parse().expect("size"),
            redop: f[3].to_string(),
            wrong_oop: f[8].to_string(),
            wrong_ip: f[12].to_string(),
            wire: f[15].parse().expect("wire bytes"),
        };
        for v in [f[5], f[6], f[7], f[9], f[10], f[11], f[13], f[14]] {
            let v: f64 = v.parse().unwrap_or_else(|_| panic!("not a number {v:?} in {line:?}"));
            assert!(v.is_finite() && v >= 0.0, "{line:?}");
        }
        out.last_mut().expect("a row before any block header").1.push(row);
    }
    out
}

/// Checks a `--op all -b 8 -e 64K` run: a block per op, a row per size, nothing wrong, and the
/// footer.
fn assert_full_table(run: &Run) {
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let blocks = blocks(&run.stdout);
    let names: Vec<&str> = blocks.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, OPS);
    for (op, rows) in &blocks {
        assert_eq!(rows.len(), 14, "{op}: 8 B .. 64 KiB is 14 sizes");
        for r in rows {
            assert_eq!((r.wrong_oop.as_str(), r.wrong_ip.as_str()), ("0", "0"), "{op} {r:?}");
            assert!(r.size <= 64 << 10);
        }
        let want = match op.as_str() {
            "all_reduce" | "reduce_scatter" | "reduce" => "sum",
            "onebit_all_reduce" | "quant_reduce_scatter" => "avg",
            _ => "none",
        };
        assert_eq!(rows[0].redop, want);
    }
    assert!(run.stdout.contains("\n# Out of bounds values : 0 OK\n"), "{}", run.stdout);
    assert!(run.stdout.contains("\n# Avg bus bandwidth : "));
}

const SMALL_ALL: [&str; 11] = ["-b", "8", "-e", "64K", "-n", "2", "-w", "1", "--op", "all", "--quiet"];

#[test]
fn threads_world_3_every_op_every_size_is_right() {
    let mut args = vec!["bench", "--transport", "threads", "--world-size", "3"];
    args.extend(SMALL_ALL);
    assert_full_table(&oxcomm(&args));
}

#[test]
fn shm_world_4_processes_every_op_every_size_is_right() {
    let mut args = vec!["bench", "--transport", "shm", "--world-size", "4"];
    args.extend(SMALL_ALL);
    assert_full_table(&oxcomm(&args));
}

/// More ranks than cores (this runs on 2-core machines): waiting ranks must not starve the
/// others.
#[test]
fn shm_world_8_oversubscribed_is_right() {
    let mut args = vec!["bench", "--world-size", "8"];
    args.extend(SMALL_ALL);
    assert_full_table(&oxcomm(&args));
}

#[test]
fn defaults_run_all_reduce_over_shm() {
    let run = oxcomm(&["bench", "-e", "1K"]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    assert!(run.stdout.contains("transport: shm"), "{}", run.stdout);
    let blocks = blocks(&run.stdout);
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].0, "all_reduce");
    let sizes: Vec<u64> = blocks[0].1.iter().map(|r| r.size).collect();
    assert_eq!(sizes, [8, 16, 32, 64, 128, 256, 512, 1024]);
}

#[test]
fn json_and_csv_have_every_field_per_op_size_and_mode() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let csv = dir.path().join("rows.csv");
    let run = oxcomm(&[
        "bench",
        "--transport",
        "threads",
        "--world-size",
        "2",
        "-b",
        "1K",
        "-e",
        "4K",
        "-n",
        "2",
        "-w",
        "0",
        "--op",
        "all_reduce,broadcast",
        "--dtype",
        "bf16",
        "--json",
        json.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let text = std::fs::read_to_string(&json).unwrap();
    let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2 * 3 * 2, "2 ops × 3 sizes × 2 modes");
    let fields = [
        "op",
        "dtype",
        "redop",
        "root",
        "world_size",
        "transport",
        "algorithm",
        "size_bytes",
        "count",
        "in_place",
        "emulated",
        "iters",
        "warmup_iters",
        "fresh_inputs",
        "time_us",
        "median_us",
        "algbw_gbps",
        "busbw_gbps",
        "wrong",
        "wire_bytes",
        "ran",
    ];
    let names = ["ring", "rd", "rhd", "star", "tree", "pairwise", "dissem", "flat", "direct", "hier"];
    for row in &rows {
        for f in fields {
            assert!(row.get(f).is_some(), "{f} missing in {row}");
        }
        // What the planner chose, as the flight recorder saw it.
        assert!(row["ran"].as_str().is_some_and(|a| names.contains(&a)), "{row}");
        assert_eq!(row["dtype"], "bf16");
        assert_eq!(row["world_size"], 2);
        assert_eq!(row["transport"], "threads");
        assert_eq!(row["wrong"], 0);
        assert_eq!(row["fresh_inputs"], false);
        assert!(row["time_us"].as_f64().unwrap() > 0.0);
        let size = row["size_bytes"].as_u64().unwrap();
        assert_eq!(row["count"].as_u64().unwrap() * 2, size);
        // busbw = algbw × 2(n−1)/n = algbw for all_reduce on 2 ranks; × 1 for broadcast.
        let (alg, bus) = (row["algbw_gbps"].as_f64().unwrap(), row["busbw_gbps"].as_f64().unwrap());
        assert!((alg - bus).abs() <= 1e-12 * alg.max(1.0), "{row}");
        let algbw = size as f64 / row["time_us"].as_f64().unwrap() / 1e3;
        assert!((alg - algbw).abs() <= 1e-9 * algbw, "{row}");
    }
    assert_eq!(rows[0]["op"], "all_reduce");
    // all_reduce has both modes (all_reduce_into out of place); broadcast emulates out-of-place.
    assert_eq!((rows[0]["in_place"].clone(), rows[0]["emulated"].clone()), (false.into(), false.into()));
    assert_eq!((rows[1]["in_place"].clone(), rows[1]["emulated"].clone()), (true.into(), false.into()));
    assert_eq!(rows[6]["op"], "broadcast");
    assert_eq!((rows[6]["in_place"].clone(), rows[6]["emulated"].clone()), (false.into(), true.into()));
    assert_eq!(rows[6]["root"], 0);
    assert!(rows[6]["redop"].is_null());

    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(header, fields);
    assert_eq!(lines.clone().count(), rows.len());
    assert!(lines.all(|l| l.split(',').count() == fields.len()));
}

/// `ran` is the algorithm the op ran: the forced one when forced.
#[test]
fn json_says_which_algorithm_ran() {
    let dir = tempfile::tempdir().unwrap();
    for algo in ["ring", "rhd"] {
        let json = dir.path().join(format!("{algo}.json"));
        let flags = format!(
            "bench --transport threads --world-size 4 -b 64K -e 64K -n 2 -w 0 --op all_reduce --algorithm {algo}"
        );
        let mut args: Vec<&str> = flags.split(' ').collect();
        args.extend(["--json", json.to_str().unwrap()]);
        let run = oxcomm(&args);
        assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
        let text = std::fs::read_to_string(&json).unwrap();
        for line in text.lines() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!((row["algorithm"].as_str(), row["ran"].as_str()), (Some(algo), Some(algo)), "{row}");
        }
    }
}

#[test]
fn fresh_inputs_rewrite_every_input_and_stay_right() {
    // Every op and mode, with a root that is not 0 (what a rank rewrites depends on both): the
    // rewrite stays inside the buffers, the barriers between ops match on every rank, the
    // results stay right and the rows say how they were timed.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fresh.json");
    let mut args = vec!["bench", "--transport", "shm", "--world-size", "3", "--root", "1", "--fresh-inputs"];
    args.extend(SMALL_ALL);
    args.extend(["--json", json.to_str().unwrap()]);
    let run = oxcomm(&args);
    assert_full_table(&run);
    assert!(run.stdout.contains("each after rewriting the inputs and a barrier"), "{}", run.stdout);
    let text = std::fs::read_to_string(&json).unwrap();
    assert!(text.lines().count() > 0);
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(row["fresh_inputs"], true, "{row}");
        assert_eq!(row["wrong"], 0, "{row}");
    }
}

#[test]
fn check_off_prints_na() {
    let run = oxcomm(&["bench", "--transport", "threads", "--world-size", "2", "-e", "64", "-c", "0"]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let rows = &blocks(&run.stdout)[0].1;
    assert!(rows.iter().all(|r| r.wrong_oop == "N/A" && r.wrong_ip == "N/A"), "{}", run.stdout);
    assert!(run.stdout.contains("# Out of bounds values : N/A"));
}

#[test]
fn bad_flags_are_one_line_errors() {
    let cases: &[&[&str]] = &[
        &["bench", "-b", "1X"],
        &["bench", "-b", "1M", "-e", "1K"],
        &["bench", "-f", "1"],
        &["bench", "-n", "0"],
        &["bench", "-n", "many"],
        &["bench", "-c", "2"],
        &["bench", "--op", "all_reduce,frobnicate"],
        &["bench", "--dtype", "f8"],
        &["bench", "--redop", "band"],
        &["bench", "--op", "broadcast", "--algorithm", "ring"],
        &["bench", "--algorithm", "fastest"],
        &["bench", "--world-size", "0"],
        &["bench", "--world-size", "2", "--op", "reduce", "--root", "5"],
        &["bench", "--transport", "carrier-pigeon"],
        &["bench", "--op", "onebit_all_reduce", "--dtype", "f16"],
        &["bench", "--op", "quant_reduce_scatter", "--dtype", "i32"],
        &["bench", "--op", "onebit_all_reduce", "--algorithm", "ring"],
        &["bench", "--world-size", "4", "--ranks-per-host", "3", "--op", "quant_reduce_scatter"],
        &["bench", "--plot", "out.pdf", "--transport", "threads", "-e", "8"],
        &["bench", "--compare", "nothere.json", "--plot", "x.svg"],
        &["bench", "--compare", "a.json"],
        &["bench", "--no-such-flag"],
        &["bench", "-e", "1T", "--transport", "threads"],
        &["bench", "--json", "/nonexistent-dir/x.json", "--transport", "threads", "-e", "8"],
    ];
    for args in cases {
        let run = oxcomm(args);
        assert!(matches!(run.code, Some(1) | Some(2)), "{args:?}: {:?} {}", run.code, run.stderr);
        let lines: Vec<&str> = run.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {:?}", run.stderr);
        assert!(lines[0].starts_with("oxcomm: error: "), "{args:?}: {:?}", run.stderr);
        assert!(!run.stderr.contains("panicked"), "{args:?}");
        assert!(!run.stdout.contains("# Out of bounds"), "{args:?}");
    }
}

/// issues 5 and 6: the compressed ops on threads and on shm processes (two "hosts" of two
/// ranks for qgZ) give exact results on their check inputs, at every size.
#[test]
fn onebit_and_quant_reduce_scatter_are_right_on_threads_and_shm() {
    let base = ["-b", "8", "-e", "1M", "-f", "8", "-n", "2", "-w", "1", "--quiet"];
    let ops = ["--op", "onebit_all_reduce,quant_reduce_scatter"];
    for (transport, world, extra) in [
        ("threads", "3", &[][..]),
        ("shm", "4", &["--ranks-per-host", "2"][..]),
        ("threads", "2", &["--dtype", "bf16"][..]),
    ] {
        let mut args = vec!["bench", "--transport", transport, "--world-size", world];
        args.extend(base);
        args.extend(if extra.contains(&"bf16") { &["--op", "quant_reduce_scatter"][..] } else { &ops[..] });
        args.extend(extra);
        let run = oxcomm(&args);
        assert_eq!(run.code, Some(0), "{args:?}: {}", run.stderr);
        let blocks = blocks(&run.stdout);
        assert_eq!(blocks.len(), if extra.contains(&"bf16") { 1 } else { 2 }, "{}", run.stdout);
        for (op, rows) in &blocks {
            assert_eq!(rows.len(), 6, "{op}: 8 B .. 1 MiB by 8 is 6 sizes");
            assert!(rows.iter().filter(|r| r.size > 0).count() >= 4, "{op}: {rows:?}");
            for r in rows {
                assert_eq!((r.wrong_oop.as_str(), r.wrong_ip.as_str()), ("0", "0"), "{transport} {op} {r:?}");
                assert_eq!(r.redop, "avg");
                // On shm every op under the compressed ones reads peers' memory (direct path):
                // nothing goes through links there.
                if r.size > 0 && transport != "shm" {
                    assert!(r.wire > 0, "{transport} {op} {r:?}");
                }
            }
        }
        assert!(run.stdout.contains("\n# Out of bounds values : 0 OK\n"), "{}", run.stdout);
    }
}

/// The `wire_bytes` of onebit_all_reduce at 1 MiB are at most 1/25 of all_reduce's in the same
/// run (1 bit per element instead of 32, plus scales and agreement).
#[test]
fn onebit_sends_a_25th_of_all_reduce() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let run = oxcomm(&[
        "bench",
        "--transport",
        "threads",
        "--world-size",
        "4",
        "-b",
        "1M",
        "-e",
        "1M",
        "-n",
        "3",
        "-w",
        "1",
        "--op",
        "all_reduce,onebit_all_reduce",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(&json).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let wire = |op: &str| -> u64 {
        rows.iter().filter(|r| r["op"] == op).map(|r| r["wire_bytes"].as_u64().unwrap()).max().unwrap()
    };
    let (full, onebit) = (wire("all_reduce"), wire("onebit_all_reduce"));
    assert!(full >= 1 << 20, "all_reduce of 1 MiB on 4 ranks sends at least 1 MiB per rank, not {full}");
    assert!(onebit > 0 && onebit * 25 <= full, "onebit {onebit} B vs all_reduce {full} B");
    // The table shows the same numbers.
    let blocks = blocks(&run.stdout);
    assert_eq!(blocks[0].1[0].wire, full);
    assert_eq!(blocks[1].1[0].wire, onebit);
    // busbw uses all_reduce's factor on the uncompressed bytes: algbw × 2(n−1)/n.
    for r in &rows {
        let (alg, bus) = (r["algbw_gbps"].as_f64().unwrap(), r["busbw_gbps"].as_f64().unwrap());
        assert!((bus - alg * 1.5).abs() <= 1e-9 * bus.max(1.0), "{r}");
    }
}

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `--plot` writes an SVG naming every op with drawn lines, and a PNG.
#[test]
fn plot_writes_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("bench.svg");
    let png = dir.path().join("bench.png");
    for path in [&svg, &png] {
        let run = oxcomm(&[
            "bench",
            "--transport",
            "threads",
            "--world-size",
            "2",
            "-e",
            "64K",
            "-n",
            "2",
            "-w",
            "0",
            "--op",
            "all_reduce,broadcast,onebit_all_reduce",
            "--plot",
            path.to_str().unwrap(),
        ]);
        assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
        assert!(run.stdout.contains(&format!("# plot: {}", path.display())), "{}", run.stdout);
    }
    let text = String::from_utf8(read(&svg)).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
    for want in [
        "all_reduce (out-of-place)",
        "all_reduce (in-place)",
        "broadcast (in-place)",
        "onebit_all_reduce (out-of-place)",
        "transport threads",
        "busbw (GB/s)",
        "message size",
    ] {
        assert!(text.contains(want), "the SVG lacks {want:?}");
    }
    let lines = text.matches("<polyline").count() + text.matches("<path").count() + text.matches("<line").count();
    assert!(lines > 50, "only {lines} line elements");
    let bytes = read(&png);
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(bytes.len() > 20_000, "a PNG of {} bytes is too small to hold the plot", bytes.len());
}

/// `--compare` draws the rows of earlier --json files, each line labelled with its file,
/// without running anything.
#[test]
fn compare_overlays_json_files() {
    let dir = tempfile::tempdir().unwrap();
    let row = |op: &str, transport: &str, size: u64, t: f64, in_place: bool| {
        format!(
            r#"{{"op":"{op}","dtype":"f32","redop":"sum","root":null,"world_size":2,"transport":"{transport}","algorithm":"auto","size_bytes":{size},"count":{},"in_place":{in_place},"emulated":false,"iters":5,"warmup_iters":1,"time_us":{t},"median_us":{t},"algbw_gbps":{},"busbw_gbps":{},"wrong":0,"wire_bytes":{size}}}"#,
            size / 4,
            size as f64 / t / 1e3,
            size as f64 / t / 1e3
        )
    };
    let a = dir.path().join("shm_run.json");
    let b = dir.path().join("tcp_run.json");
    let rows_a = [row("all_reduce", "shm", 1024, 3.0, false), row("all_reduce", "shm", 4096, 5.0, false)];
    let rows_b = [row("all_reduce", "tcp", 1024, 30.0, true), row("all_reduce", "tcp", 4096, 50.0, true)];
    std::fs::write(&a, rows_a.join("\n") + "\n").unwrap();
    std::fs::write(&b, rows_b.join("\n") + "\n").unwrap();
    let out = dir.path().join("cmp.svg");
    let run =
        oxcomm(&["bench", "--compare", a.to_str().unwrap(), b.to_str().unwrap(), "--plot", out.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    assert!(run.stdout.is_empty(), "--compare runs nothing: {}", run.stdout);
    let text = String::from_utf8(read(&out)).unwrap();
    for want in ["shm_run: all_reduce (out-of-place)", "tcp_run: all_reduce (in-place)", "transport shm/tcp"] {
        assert!(text.contains(want), "the SVG lacks {want:?}");
    }
    let png = dir.path().join("cmp.png");
    let run =
        oxcomm(&["bench", "--compare", a.to_str().unwrap(), b.to_str().unwrap(), "--plot", png.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    assert!(read(&png).starts_with(b"\x89PNG"));
    // A file that is not bench JSON is a one-line error.
    std::fs::write(&a, "not json\n").unwrap();
    let run = oxcomm(&["bench", "--compare", a.to_str().unwrap(), "--plot", out.to_str().unwrap()]);
    assert_eq!(run.code, Some(1));
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(run.stderr.contains("shm_run.json:1"), "{}", run.stderr);
}
