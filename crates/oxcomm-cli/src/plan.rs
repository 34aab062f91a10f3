//! `oxcomm plan`: what the planner would do with an all-reduce on a cluster described by its
//! flags, and what each algorithm would cost there, from the library's cost model
//! (`oxcomm::algorithms::cost`) and its planner (`oxcomm::algorithms::plan::choose`), the
//! same calls a job makes. It runs nothing and needs no cluster.
//!
//! Flags are parsed into [`PlanArgs`] (what was typed), then into a list of cases (what is
//! priced); each case is a row: size, hosts, ranks per host, every algorithm's predicted time
//! in µs (`-` where it cannot run) and the planner's choice.

use anyhow::bail;
use clap::Args;
use oxcomm::algorithms::cost::{self, Network, Shape};
use oxcomm::algorithms::plan::{self, Across};
use oxcomm::wire::OpKind;

use crate::bench::parse_size;

/// Flags of `oxcomm plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Number of hosts; a comma-separated list prices each (64,256,1024).
    #[arg(long = "hosts", value_name = "N[,N...]", value_delimiter = ',', required = true)]
    pub hosts: Vec<usize>,

    /// Ranks on each host (shared memory inside a host, TCP across).
    #[arg(long = "ranks-per-host", visible_alias = "ranks_per_host", value_name = "R", default_value_t = 1)]
    pub ranks_per_host: usize,

    /// Speed of each host's link, each way: a number with gbit, mbit or kbit (100gbit,
    /// 25Gbit, 400gbit); a bare number is Gbit/s.
    #[arg(long = "link", value_name = "RATE", default_value = "10gbit", value_parser = parse_rate)]
    pub link: f64,

    /// One-way time of a small message between hosts, software included: a number with us,
    /// ms or ns (5us, 0.02ms); a bare number is µs.
    #[arg(long = "latency", value_name = "TIME", default_value = "25us", value_parser = parse_latency)]
    pub latency: f64,

    /// Bytes per rank of the all-reduce (K, M, G suffixes as in `oxcomm bench`); a
    /// comma-separated list prices each (8,64K,64M).
    #[arg(long = "size", value_name = "BYTES[,BYTES...]", value_delimiter = ',', value_parser = parse_size, required = true)]
    pub size: Vec<u64>,
}

/// Parses a number followed by one of `units` (suffix, scale), or a bare number (scale 1);
/// `None` unless positive and finite.
fn scaled(raw: &str, units: &[(&str, f64)]) -> Option<f64> {
    let s = raw.trim().to_ascii_lowercase();
    let (digits, scale) = units
        .iter()
        .find_map(|(unit, scale)| s.strip_suffix(unit).map(|d| (d.to_string(), *scale)))
        .unwrap_or((s, 1.0));
    digits.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0).map(|v| v * scale)
}

/// Parses a link speed into Gbit/s.
fn parse_rate(raw: &str) -> Result<f64, String> {
    let units = [("gbit/s", 1.0), ("gbps", 1.0), ("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6), ("g", 1.0)];
    scaled(raw, &units).ok_or_else(|| format!("{raw:?} is not a link speed (examples: 1gbit, 100gbit, 400Gbit, 25)"))
}

/// Parses a latency into µs.
fn parse_latency(raw: &str) -> Result<f64, String> {
    let units = [("µs", 1.0), ("us", 1.0), ("ms", 1e3), ("ns", 1e-3)];
    scaled(raw, &units).ok_or_else(|| format!("{raw:?} is not a time (examples: 5us, 20µs, 0.1ms, 800ns)"))
}

/// The algorithms a row prices, in column order.
const COLUMNS: [oxcomm::Algorithm; 4] = [
    oxcomm::Algorithm::RecursiveDoubling,
    oxcomm::Algorithm::HalvingDoubling,
    oxcomm::Algorithm::Ring,
    oxcomm::Algorithm::Hierarchical,
];

/// Runs `oxcomm plan`: prints the table; exit status 0.
pub fn run(args: PlanArgs) -> anyhow::Result<i32> {
    if args.hosts.contains(&0) || args.ranks_per_host == 0 {
        bail!("--hosts and --ranks-per-host must be at least 1");
    }
    let net = Network::new(args.latency, args.link);
    // One rank per host: TCP everywhere, where small all-reduces fold their agreement into
    // their data; several: shared memory inside each host and TCP across.
    let folds = args.ranks_per_host == 1;
    println!(
        "# oxcomm plan: all_reduce, {} rank(s) per host, links {} Gbit/s, one-way {} µs ({}); predicted µs, agreement included",
        args.ranks_per_host,
        args.link,
        args.latency,
        if folds { "TCP between every pair" } else { "shared memory inside a host, TCP across" }
    );
    let mut head = format!("{:>12} {:>6} {:>6}", "size(B)", "hosts", "ranks");
    for a in COLUMNS {
        head.push_str(&format!(" {:>12}", format!("{}(us)", a.name())));
    }
    head.push_str(&format!(" {:>7}", "choice"));
    println!("{head}");
    for &hosts in &args.hosts {
        let shape = Shape { hosts, ranks_per_host: args.ranks_per_host };
        let ranks = shape.ranks();
        let across = Across { net, shape, folds };
        let even = hosts >= 2 && args.ranks_per_host >= 2;
        for &size in &args.size {
            let bytes = usize::try_from(size)?;
            let folded = across.folds_at(OpKind::AllReduce, bytes);
            let choice = plan::choose(
                OpKind::AllReduce,
                bytes,
                (bytes / 4).max(ranks),
                ranks,
                None,
                false,
                even,
                Some(&across),
            )?;
            let mut row = format!("{bytes:>12} {hosts:>6} {ranks:>6}");
            for a in COLUMNS {
                let cell = match cost::all_reduce(
                    a,
                    shape,
                    &net,
                    bytes,
                    folded && a == oxcomm::Algorithm::RecursiveDoubling,
                ) {
                    Some(t) => format!("{:.1}", t * 1e6),
                    None => "-".to_string(),
                };
                row.push_str(&format!(" {cell:>12}"));
            }
            row.push_str(&format!(" {:>7}", choice.name()));
            println!("{row}");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_latencies_parse() {
        assert_eq!(parse_rate("100gbit").unwrap(), 100.0);
        assert_eq!(parse_rate("25Gbit").unwrap(), 25.0);
        assert_eq!(parse_rate("400").unwrap(), 400.0);
        assert!((parse_rate("100mbit").unwrap() - 0.1).abs() < 1e-12);
        assert!(parse_rate("fast").is_err() && parse_rate("0gbit").is_err() && parse_rate("-1").is_err());
        assert_eq!(parse_latency("5us").unwrap(), 5.0);
        assert_eq!(parse_latency("20µs").unwrap(), 20.0);
        assert_eq!(parse_latency("0.1ms").unwrap(), 100.0);
        assert_eq!(parse_latency("800ns").unwrap(), 0.8);
        assert!(parse_latency("soon").is_err() && parse_latency("0us").is_err());
    }
}
