/* A test-tier shim for oversubscribed runs of an MPI built on UCX (Debian's MPICH 4.0 is
 * ch4:ucx): preloaded (LD_PRELOAD) into each rank, it gives the core away (sched_yield) whenever
 * UCX's progress call finds nothing to do.
 *
 * Why: that MPICH's blocking calls (HDF5's collective MPI-IO makes them) poll without ever
 * yielding, so with more ranks than cores a rank waiting in a collective keeps its core until
 * the scheduler's tick preempts it, and every collective costs about two ticks: an MPI_Barrier
 * at 3-4 ranks on 2 cores took 8 ms (1 us with this shim), and the parallel-HDF5 4-rank test run
 * 59 s (6 s). It changes no call MPI makes and no result, only when the waiting rank lets
 * another process run; with a core per rank a yield with nothing else to run returns at once.
 * Not part of the library: the library's own waits yield already (dtorch_mpi/comm/deadline.py). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stddef.h>

typedef unsigned (*progress_fn)(void *worker);

unsigned ucp_worker_progress(void *worker) {
    static progress_fn real;
    if (real == NULL) {
        /* libucp comes in with MPI's library, loaded by mpi4py without RTLD_GLOBAL: look it up by name */
        void *ucp = dlopen("libucp.so.0", RTLD_NOW | RTLD_NOLOAD);
        real = (progress_fn)dlsym(ucp != NULL ? ucp : RTLD_NEXT, "ucp_worker_progress");
        if (real == NULL)
            return 0;
    }
    unsigned events = real(worker);
    if (events == 0)
        sched_yield();
    return events;
}
