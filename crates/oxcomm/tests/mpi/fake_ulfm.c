/* A stand-in for ULFM's five functions on an MPI library without them (Open MPI 4), loaded
 * with LD_PRELOAD by the `mpi` test's ULFM job, so that the MPI backend's mapping (found at
 * run time with dlsym) runs: no rank really fails. FAKE_ULFM_FAILED=k plays a failure of rank
 * k of MPI_COMM_WORLD that only world rank 0 has acknowledged (so the agreement must spread it),
 * and that MPIX_Comm_shrink leaves out (rank k itself gets an error, as a rank the others gave
 * up on would). Agree is an all-reduce with BAND; revoke only counts its calls, which the test
 * reads with fake_ulfm_revokes(). */
#include <mpi.h>
#include <stdlib.h>

static int revokes = 0;

int fake_ulfm_revokes(void) { return revokes; }

/* The failed rank's rank in `comm`, or -1. */
static int failed_in(MPI_Comm comm) {
    const char *k = getenv("FAKE_ULFM_FAILED");
    if (!k) return -1;
    int world = atoi(k), out = MPI_UNDEFINED;
    MPI_Group wg, cg;
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    MPI_Comm_group(comm, &cg);
    MPI_Group_translate_ranks(wg, 1, &world, cg, &out);
    MPI_Group_free(&wg);
    MPI_Group_free(&cg);
    return out == MPI_UNDEFINED ? -1 : out;
}

int MPIX_Comm_revoke(MPI_Comm comm) {
    (void)comm;
    revokes++;
    return MPI_SUCCESS;
}

int MPIX_Comm_failure_ack(MPI_Comm comm) {
    (void)comm;
    return MPI_SUCCESS;
}

int MPIX_Comm_failure_get_acked(MPI_Comm comm, MPI_Group *failed) {
    int me, k = failed_in(comm);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (me != 0 || k < 0) {
        *failed = MPI_GROUP_EMPTY;
        return MPI_SUCCESS;
    }
    MPI_Group g;
    MPI_Comm_group(comm, &g);
    MPI_Group_incl(g, 1, &k, failed);
    MPI_Group_free(&g);
    return MPI_SUCCESS;
}

int MPIX_Comm_agree(MPI_Comm comm, int *flag) {
    return MPI_Allreduce(MPI_IN_PLACE, flag, 1, MPI_INT, MPI_BAND, comm);
}

int MPIX_Comm_shrink(MPI_Comm comm, MPI_Comm *newcomm) {
    int me, k = failed_in(comm);
    MPI_Comm_rank(comm, &me);
    int rc = MPI_Comm_split(comm, me == k ? MPI_UNDEFINED : 0, me, newcomm);
    return rc != MPI_SUCCESS ? rc : me == k ? MPI_ERR_OTHER : MPI_SUCCESS;
}
