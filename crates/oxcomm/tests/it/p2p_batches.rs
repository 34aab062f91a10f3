//! Point-to-point messages grouped into batches differently on the two sides: a rank's pending
//! `isend`/`irecv`s start together when one of them is waited on, so one side may send two
//! messages as two batches while the other receives them as one (or the reverse). Each
//! message is whole in the stream, so every grouping reads the same bytes.

use oxcomm::threads;

/// Sizes that fit a link's buffer and sizes that do not (the thread link holds 1 MiB).
const SIZES: [usize; 3] = [3, 1000, 600_000];

#[test]
fn messages_sent_one_batch_each_are_received_in_one_batch() {
    for len in SIZES {
        let out = threads::run(2, |comm| -> oxcomm::Result<Vec<Vec<f32>>> {
            if comm.rank() == 0 {
                for k in 0..3 {
                    comm.isend(vec![k as f32; len + k], 1, 5).wait()?;
                }
                Ok(vec![])
            } else {
                let works: Vec<_> = (0..3).map(|k| comm.irecv(vec![0.0f32; len + k], 0, 5)).collect();
                works.into_iter().map(|w| w.wait()).collect()
            }
        })
        .unwrap();
        let got = out[1].as_ref().unwrap();
        for (k, v) in got.iter().enumerate() {
            assert!(v.len() == len + k && v.iter().all(|&x| x == k as f32), "len {len}: message {k}");
        }
    }
}

#[test]
fn messages_sent_in_one_batch_are_received_one_by_one_and_from_any_source() {
    for len in SIZES {
        let out = threads::run(3, |comm| -> oxcomm::Result<Vec<(usize, Vec<i32>)>> {
            match comm.rank() {
                0 => {
                    // Both sends and an exchange's receive in one batch.
                    let a = comm.isend(vec![1i32; len], 2, 0);
                    let b = comm.isend(vec![2i32; len + 1], 2, 0);
                    let c = comm.irecv(vec![0i32; 1], 2, 9);
                    a.wait()?;
                    b.wait()?;
                    c.wait()?;
                    Ok(vec![])
                }
                1 => Ok(vec![]),
                _ => {
                    let mut first = vec![0i32; len];
                    let src = comm.recv_any(&mut first, 0)?;
                    let mut second = vec![0i32; len + 1];
                    comm.recv(&mut second, 0, 0)?;
                    comm.send(&[7i32], 0, 9)?;
                    Ok(vec![(src, first), (0, second)])
                }
            }
        })
        .unwrap();
        let got = out[2].as_ref().unwrap();
        assert_eq!(got[0].0, 0);
        assert!(got[0].1.iter().all(|&x| x == 1) && got[1].1.iter().all(|&x| x == 2), "len {len}");
    }
}
