/* superoffload asynchronous file I/O: the C declaration (DESIGN.md §7, "I/O is a lane").
 *
 * Three layers, as for the CPU Adam kernel (docs/conventions.md, "Kernel bindings in three
 * layers"): this header is the declaration; cext/build_aio.py compiles it into the private
 * module superoffload.storage._aio_cffi; the thin wrapper superoffload/storage/aio_c.py
 * checks every argument and turns every return code into an exception. The library holds
 * no global state: a ring (so_aio_ctx) holds all of it, and one thread drives a ring.
 *
 * A ring serves requests (a file range to or from one buffer). It cuts each into blocks of
 * at most block_bytes and keeps up to queue_depth blocks in flight in the kernel, taking
 * one block from each unfinished request in turn, so a small request never waits behind a
 * large one. A block goes through the O_DIRECT descriptor when its file offset, memory
 * address and length are all multiples of align_bytes, else through the buffered one (the
 * unaligned head and tail of a request; docs/storage.md, "I/O engine").
 *
 * Backends: io_uring (liburing) and Linux AIO (libaio), each compiled in only when
 * cext/build_aio.py found its headers (so_aio_backends_built). Completions are signalled
 * on an eventfd that so_aio_run polls together with a second one, the wake-up, which any
 * thread may signal (so_aio_wake) to make a blocked so_aio_run return.
 *
 * The block between CDEF-BEGIN and CDEF-END is fed verbatim to cffi's cdef, so it holds
 * only declarations cffi understands (no preprocessor conditionals).
 */
#ifndef SO_AIO_H
#define SO_AIO_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
/* Bumped whenever a declaration below changes; the wrapper refuses a stale build. */
#define SO_AIO_ABI_VERSION 1

/* backends (bits of so_aio_backends_built) */
#define SO_AIO_IO_URING 1
#define SO_AIO_LIBAIO 2

/* return codes besides 0 and -errno; the wrapper maps each to an exception */
#define SO_AIO_ERR_ARG -100001        /* an argument is out of range */
#define SO_AIO_ERR_BACKEND -100002    /* the backend is not compiled in */
#define SO_AIO_ERR_FULL -100003       /* every request slot is taken */
/* so_aio_completion.error besides 0 and -errno */
#define SO_AIO_ERR_EOF -100010        /* a read met the end of the file */
#define SO_AIO_ERR_ZERO_WRITE -100011 /* a write transferred nothing */

typedef struct so_aio_ctx so_aio_ctx;

/* One transfer: nbytes between buf and the file at offset. */
typedef struct so_aio_request {
    int fd_direct;      /* opened with O_DIRECT, or -1: every block goes buffered */
    int fd_buffered;    /* the same file without O_DIRECT */
    int is_write;       /* 1: buf -> file; 0: file -> buf */
    void *buf;
    int64_t offset;     /* in the file, bytes */
    int64_t nbytes;
    uint64_t tag;       /* the caller's id, given back in its completion */
} so_aio_request;

typedef struct so_aio_completion {
    uint64_t tag;
    int64_t done_bytes;     /* bytes transferred */
    int32_t error;          /* 0, -errno, SO_AIO_ERR_EOF or SO_AIO_ERR_ZERO_WRITE */
    int64_t error_offset;   /* file offset of the block that failed (first failure) */
} so_aio_completion;

int so_aio_abi_version(void);
/* bit mask of SO_AIO_IO_URING / SO_AIO_LIBAIO compiled into this build */
int so_aio_backends_built(void);
/* A new ring; 0 or -errno (the kernel refused the backend) or SO_AIO_ERR_*. block_bytes and
 * align_bytes: powers of two with align_bytes <= block_bytes <= 1 GiB. */
int so_aio_create(int backend, int queue_depth, int max_requests, int64_t block_bytes,
                  int64_t align_bytes, so_aio_ctx **out);
/* Waits for every block in flight (the kernel may still be writing into the buffers), then
 * frees the ring. Requests not reported by so_aio_run are dropped. NULL is a no-op. */
void so_aio_destroy(so_aio_ctx *ctx);
/* Queues a request; its blocks are issued by so_aio_run. 0 or SO_AIO_ERR_*. */
int so_aio_submit(so_aio_ctx *ctx, const so_aio_request *req);
/* Makes a so_aio_run blocked in another thread return (or the next one return at once).
 * The only call that may be made from any thread. 0 or -errno. */
int so_aio_wake(so_aio_ctx *ctx);
/* Issues blocks, then waits until at least one request finished, the ring was woken,
 * timeout_ms passed (-1: no limit) or nothing is left in flight. Writes finished requests
 * to out (at most max_out) and returns how many, or -errno when the ring itself failed. */
int so_aio_run(so_aio_ctx *ctx, int timeout_ms, so_aio_completion *out, int max_out);
/* Requests submitted and not yet reported by so_aio_run. */
int so_aio_pending(const so_aio_ctx *ctx);
/* CDEF-END */

#endif /* SO_AIO_H */
