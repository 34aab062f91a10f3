//! The comms logger wired into the communicator: every op is recorded with its fields, the
//! summary and straggler view work across ranks, and a disabled logger records nothing.

use oxcomm::logging::LoggerConfig;
use oxcomm::{threads, CommConfig, DType, ReduceOp};

fn logged() -> CommConfig {
    CommConfig {
        logger: LoggerConfig { enabled: true, prof_all: true, ..LoggerConfig::default() },
        ..CommConfig::default()
    }
}

#[test]
fn every_op_is_recorded_with_its_fields() {
    let out = threads::run_with(3, logged(), |comm| {
        let mut v = vec![1.0f32; 1000];
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        comm.barrier().unwrap();
        comm.broadcast(&mut v, 1).unwrap();
        let mut all = vec![0i32; 6];
        comm.all_gather(&[1, 2], &mut all).unwrap();
        comm.monitored_barrier(std::time::Duration::from_secs(5)).unwrap();
        let g = comm.new_group(&[0, 2]).unwrap();
        if let Some(g) = g {
            g.all_reduce(&mut v[..10], ReduceOp::Max).unwrap();
        }
        let summary = comm.log_summary(true).unwrap();
        (comm.logger().records(), summary)
    })
    .unwrap();
    for (rank, (records, summary)) in out.into_iter().enumerate() {
        let ops: Vec<&str> = records.iter().map(|r| r.op).collect();
        let mut want = vec!["all_reduce", "barrier", "broadcast", "all_gather", "monitored_barrier", "new_group"];
        if rank != 1 {
            want.push("all_reduce");
        }
        assert_eq!(ops, want, "rank {rank}");
        let ar = &records[0];
        assert_eq!((ar.dtype, ar.count, ar.bytes, ar.group_size, ar.seq), (Some(DType::F32), 1000, 4000, 3, 0));
        assert_eq!(ar.transport, "threads");
        assert!(!ar.algorithm.is_empty());
        assert!(ar.latency_ns > 0 && ar.algbw_gbps() > 0.0 && ar.busbw_gbps() > 0.0);
        assert_eq!(records[3].bytes, 8, "all_gather logs one rank's input");
        if rank != 1 {
            assert_eq!(records[6].group_size, 2);
            assert_eq!(records[6].seq, 0, "groups count their own sequence");
        }
        assert!(summary.contains("all_reduce") && summary.contains("broadcast"), "{summary}");
        assert!(summary.contains("Total straggler(ms)"), "straggler view present: {summary}");
    }
}

#[test]
fn a_disabled_logger_records_nothing() {
    let out = threads::run(2, |comm| {
        let mut v = [1u8; 4];
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        comm.logger().op_count()
    })
    .unwrap();
    assert_eq!(out, vec![0, 0]);
}

#[test]
fn compressed_collectives_are_recorded_under_their_names() {
    use oxcomm::compression::{coalesced, onebit, qgz};
    let out = threads::run_with(2, logged(), |comm| {
        let mut v = vec![1.0f32; 64];
        let mut state = onebit::OneBitState::new(v.len(), comm.size()).unwrap();
        onebit::all_reduce(&comm, &mut v, &mut state).unwrap();
        let t = [1.0f32; 10];
        coalesced::reduce_scatter_coalesced(&comm, &[&t[..]]).unwrap();
        let x = vec![0.5f32; 64];
        let view = qgz::TensorView::new(&x, &[8, 8]).unwrap();
        qgz::all_to_all_quant_reduce(&comm, &[view], None).unwrap();
        comm.logger().records()
    })
    .unwrap();
    for records in out {
        let find = |op: &str| records.iter().find(|r| r.op == op).unwrap_or_else(|| panic!("{op} not logged"));
        let ob = find("onebit_all_reduce");
        assert_eq!((ob.count, ob.bytes, ob.group_size), (64, 256, 2));
        assert_eq!(find("reduce_scatter_coalesced").bytes, 40);
        assert_eq!(find("quant_reduce_scatter").bytes, 256);
        // The collectives they ran inside are recorded too.
        assert!(records.iter().any(|r| r.op == "all_to_all"));
    }
}

#[test]
fn object_collectives_are_recorded_under_their_names() {
    let out = threads::run_with(2, logged(), |comm| {
        let got = comm.broadcast_object((comm.rank() == 0).then(|| vec![7u32; 3]), 0).unwrap();
        let all = comm.all_gather_object(&format!("rank{}", comm.rank())).unwrap();
        comm.all_gather_bytes(&[1, 2, 3]).unwrap();
        (got, all, comm.logger().records())
    })
    .unwrap();
    for (got, all, records) in out {
        assert_eq!((got, all), (vec![7; 3], vec!["rank0".to_string(), "rank1".to_string()]));
        let find = |op: &str| records.iter().find(|r| r.op == op).unwrap_or_else(|| panic!("{op} not logged"));
        // postcard: a varint length, then the bytes (4 for [7, 7, 7] as varints, 6 for "rankN").
        assert_eq!(find("broadcast_object").bytes, 4);
        assert_eq!(find("all_gather_object").bytes, 6);
        assert_eq!((find("all_gather_bytes").count, find("all_gather_bytes").bytes), (3, 3));
        assert!(records.iter().any(|r| r.op == "all_gather"));
    }
}
