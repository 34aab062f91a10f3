//! The dtypes that came after the first eight (bool, i16, u16, u32, u64, complex64/128 and the
//! float8 types): every collective × op that fits, on thread ranks, through the
//! `CollectiveTester` (the shared-memory run is `multiproc::new_dtypes_over_shm`); the scalar
//! reference itself checked against independent arithmetic; and the combinations oxcomm does
//! not reduce refused with an error naming the rank, the op and the dtype.

use oxcomm::dtype::{Bool, Complex128, Complex64, F8E4M3Fn, F8E5M2};
use oxcomm::reduce::{self, ReduceOp};
use oxcomm::{threads, DType, Element, ErrorKind};

use crate::collectives::{expected, input, CollectiveTester, BASE_DTYPES};

/// Every dtype the base matrix leaves out: [`DType::ALL`] after [`BASE_DTYPES`] (tag order), so a
/// dtype added later is in this matrix without an edit here.
pub const NEW_DTYPES: &[DType] = DType::ALL.split_at(BASE_DTYPES.len()).1;

fn tester() -> CollectiveTester {
    CollectiveTester::new().dtypes(NEW_DTYPES).worlds(&[1, 2, 3, 4]).counts(&[0, 1, 7, 1000]).segments(&[1 << 20, 64])
}

#[test]
fn new_dtypes_all_reduce_matrix() {
    tester().run_all_reduce();
}

#[test]
fn new_dtypes_rooted_and_movement_matrix() {
    let t = tester();
    t.run_rooted();
    t.run_gather_scatter();
}

#[test]
fn new_dtypes_all_gather_and_reduce_scatter_matrix() {
    let t = tester();
    t.run_all_gather();
    t.run_reduce_scatter();
}

/// The tester's reference (the scalar kernels folded in rank order) against arithmetic written
/// out here: bool as torch defines it, complex sums part by part and products in f64.
#[test]
fn the_reference_is_torch_arithmetic() {
    for size in 1..=5 {
        let count = 40;
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::BXor] {
            let got = expected::<Bool>(size, count, op);
            for (i, g) in got.iter().enumerate() {
                let vals: Vec<bool> = (0..size).map(|r| input::<Bool>(r, i, op).get()).collect();
                let want = match op {
                    ReduceOp::Sum | ReduceOp::Max => vals.iter().any(|v| *v),
                    ReduceOp::Prod | ReduceOp::Min => vals.iter().all(|v| *v),
                    _ => vals.iter().fold(false, |a, v| a ^ v),
                };
                assert_eq!(*g, Bool::from(want), "bool {op} size {size} at {i}");
            }
        }
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
            let got64 = expected::<Complex64>(size, count, op);
            let got128 = expected::<Complex128>(size, count, op);
            for i in 0..count {
                let vals: Vec<(f64, f64)> = (0..size)
                    .map(|r| {
                        let z = input::<Complex128>(r, i, op);
                        (z.re, z.im)
                    })
                    .collect();
                let want = match op {
                    ReduceOp::Prod => {
                        vals.iter().skip(1).fold(vals[0], |(a, b), &(c, d)| (a * c - b * d, a * d + b * c))
                    }
                    _ => {
                        let s = vals.iter().fold((0.0, 0.0), |(a, b), &(c, d)| (a + c, b + d));
                        if op == ReduceOp::Avg {
                            (s.0 / size as f64, s.1 / size as f64)
                        } else {
                            s
                        }
                    }
                };
                assert_eq!((got128[i].re, got128[i].im), want, "c128 {op} size {size} at {i}");
                assert_eq!(got64[i], Complex64::new(want.0 as f32, want.1 as f32), "c64 {op} size {size} at {i}");
            }
        }
    }
}

/// Any non-zero byte is true, and results are canonical 0 or 1 (torch reads a bool byte as
/// non-zero; a result of 2 would compare unequal to `True` byte for byte).
#[test]
fn bool_reductions_read_any_nonzero_byte_as_true_and_write_0_or_1() {
    let a = [Bool(0), Bool(2), Bool(255), Bool(0)];
    let b = [Bool(0), Bool(0), Bool(7), Bool(1)];
    for (op, want) in [
        (ReduceOp::Sum, [0, 1, 1, 1]),
        (ReduceOp::Max, [0, 1, 1, 1]),
        (ReduceOp::Prod, [0, 0, 1, 0]),
        (ReduceOp::Min, [0, 0, 1, 0]),
        (ReduceOp::BXor, [0, 1, 0, 1]),
    ] {
        let mut d = a;
        reduce::reduce_into(&mut d, &b, op);
        assert_eq!(d.map(|x| x.0), want, "{op}");
    }
}

#[test]
fn unsupported_combinations_name_rank_op_and_dtype() {
    let out = threads::run(2, |comm| {
        let mut errors = Vec::new();
        let mut f8 = vec![F8E4M3Fn::from_f64(1.0); 4];
        errors.push(comm.all_reduce(&mut f8, ReduceOp::Sum).unwrap_err());
        let mut f8b = vec![F8E5M2::from_f64(1.0); 4];
        errors.push(comm.reduce(&mut f8b, 0, ReduceOp::Max).unwrap_err());
        let mut c = vec![Complex64::new(1.0, 2.0); 4];
        errors.push(comm.all_reduce(&mut c, ReduceOp::Max).unwrap_err());
        let mut c2 = vec![Complex128::new(1.0, 2.0); 4];
        errors.push(comm.all_reduce(&mut c2, ReduceOp::BXor).unwrap_err());
        let mut b = vec![Bool(1); 4];
        errors.push(comm.all_reduce(&mut b, ReduceOp::Avg).unwrap_err());
        let input = vec![F8E4M3Fn::from_f64(1.0); 4];
        let mut output = vec![F8E4M3Fn::default(); 2];
        errors.push(comm.reduce_scatter(&input, &mut output, ReduceOp::Sum).unwrap_err());
        // The group is still usable: nothing was sent, and float8 moves.
        let mut moved = vec![F8E4M3Fn::from_f64(comm.rank() as f64 + 0.5); 3];
        comm.broadcast(&mut moved, 1)?;
        assert_eq!(moved, vec![F8E4M3Fn::from_f64(1.5); 3]);
        Ok::<_, oxcomm::Error>(errors)
    })
    .unwrap();
    for (rank, errors) in out.into_iter().enumerate() {
        let errors = errors.unwrap();
        let want = [
            ("all_reduce", "sum", "f8e4m3fn"),
            ("reduce", "max", "f8e5m2"),
            ("all_reduce", "max", "c64"),
            ("all_reduce", "bxor", "c128"),
            ("all_reduce", "avg", "bool"),
            ("reduce_scatter", "sum", "f8e4m3fn"),
        ];
        assert_eq!(errors.len(), want.len());
        for (e, (op, redop, dtype)) in errors.iter().zip(want) {
            assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
            assert_eq!(e.rank(), Some(rank), "{e}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("rank {rank}: {op} #")), "{text}");
            assert!(text.contains(&format!("reduce op {redop} on {dtype} is not supported")), "{text}");
        }
    }
}

#[test]
fn fits_is_torchs_table() {
    for &d in NEW_DTYPES {
        for op in ReduceOp::ALL {
            let want = match d {
                DType::Bool => op != ReduceOp::Avg,
                DType::C64 | DType::C128 => matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Prod),
                DType::I16 | DType::U16 | DType::U32 | DType::U64 => true,
                _ => false,
            };
            assert_eq!(op.fits(d), want, "{op} on {d}");
            assert_eq!(reduce::check(op, d).is_ok(), want, "{op} on {d}");
        }
    }
}

#[test]
fn the_base_dtypes_open_the_tag_order() {
    assert_eq!(DType::ALL[..BASE_DTYPES.len()], BASE_DTYPES);
}

#[test]
fn premul_sum_scales_each_ranks_input_by_its_factor_then_sums() {
    // Rank r's input x_r[i] = i + r, its factor r + 2 (integers: every product and sum exact);
    // complex factors (1, r) multiply as complex numbers. Compared with sum_r(f_r * x_r).
    let n = 3;
    let len = 150; // more than one piece of the scaling loop
    let out = threads::run(n, |comm| {
        let r = comm.rank();
        let mut f = (0..len).map(|i| (i + r) as f32).collect::<Vec<_>>();
        comm.all_reduce_premul_sum(&mut f, (r + 2) as f32).unwrap();
        let mut k = (0..len).map(|i| (i + r) as i64).collect::<Vec<_>>();
        comm.all_reduce_premul_sum(&mut k, (r + 2) as i64).unwrap();
        let mut c = (0..len).map(|i| Complex64::new(i as f32, r as f32)).collect::<Vec<_>>();
        comm.all_reduce_premul_sum(&mut c, Complex64::new(1.0, r as f32)).unwrap();
        // float8 cannot be summed: refused before the buffer is touched.
        let mut f8 = vec![F8E4M3Fn::from_f64(1.0); 4];
        let e = comm.all_reduce_premul_sum(&mut f8, F8E4M3Fn::from_f64(2.0)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.op().is_some_and(|op| op.contains("premul sum")), "{e}");
        assert!(f8.iter().all(|&x| x == F8E4M3Fn::from_f64(1.0)));
        (f, k, c)
    })
    .unwrap();
    for i in 0..len {
        let want: i64 = (0..n).map(|r| ((i + r) * (r + 2)) as i64).sum();
        // (i + r·j)(1 + r·j) = (i − r²) + (r·i + r)·j
        let (re, im): (f32, f32) = (0..n)
            .map(|r| ((i as f32 - (r * r) as f32), (r * i + r) as f32))
            .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        for (rank, (f, k, c)) in out.iter().enumerate() {
            assert_eq!(f[i], want as f32, "f32 at {i} on rank {rank}");
            assert_eq!(k[i], want, "i64 at {i} on rank {rank}");
            assert_eq!(c[i], Complex64::new(re, im), "c64 at {i} on rank {rank}");
        }
    }
}
