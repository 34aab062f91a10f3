use std::time::Instant;
fn main() -> Result<(), oxcomm::Error> {
    let comm = oxcomm::init()?;
    let n = comm.size() as f64;
    for &bytes in &[8usize, 1024, 65536, 1 << 20, 8 << 20, 32 << 20, 128 << 20] {
        let count = bytes / 4;
        let mut buf = vec![1.0f32; count];
        let iters = if bytes < (1 << 20) {
            2000
        } else if bytes < (32 << 20) {
            50
        } else {
            10
        };
        for _ in 0..5 {
            comm.all_reduce(&mut buf, oxcomm::ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&mut buf, oxcomm::ReduceOp::Sum)?;
        }
        let t = t0.elapsed().as_secs_f64() / iters as f64;
        if comm.rank() == 0 {
            let algbw = bytes as f64 / t / 1e9;
            println!("{bytes:>10} B  {:>10.2} us  busbw {:.2} GB/s", t * 1e6, algbw * 2.0 * (n - 1.0) / n);
        }
    }
    Ok(())
}
