/* The value of MPI_IN_PLACE, which is a macro (a cast pointer constant) in every MPI's mpi.h
 * and so cannot be reached through generated bindings. Built only with feature `mpi`. */
#include <mpi.h>

void *oxcomm_mpi_in_place(void) { return MPI_IN_PLACE; }
