//! Hello, all-reduce across processes. Run with `oxcomm launch -n 4 -- target/release/examples/hello`
//! (or torchrun / mpirun with `OXCOMM_TOKEN` exported to every rank).

fn main() -> Result<(), oxcomm::Error> {
    let comm = oxcomm::init()?;
    let mut v = vec![comm.rank() as f32 + 1.0; 4];
    comm.all_reduce(&mut v, oxcomm::ReduceOp::Sum)?;
    println!("rank {} of {} over {}: sum = {:?}", comm.rank(), comm.size(), comm.transport(), v);
    Ok(())
}
