/* superoffload asynchronous file I/O: the kernel interfaces (cext/so_aio.h).
 *
 * io_uring through liburing, and Linux AIO through libaio, each compiled only when
 * cext/build_aio.py found its headers (SO_AIO_HAVE_URING, SO_AIO_HAVE_LIBAIO). Both hand
 * READY blocks to the kernel, signal ctx->done_fd on every completion, and report each
 * completion to so_aio_block_done; the request logic is in so_aio.c.
 */
#define _GNU_SOURCE
#include "so_aio_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

#ifdef SO_AIO_HAVE_URING
static int uring_open(so_aio_ctx *ctx)
{
    /* the completion queue is twice the submission queue: never more than queue_depth
     * blocks are in flight, so it cannot overflow */
    int rc = io_uring_queue_init((unsigned)ctx->queue_depth, &ctx->ring, 0);
    if (rc < 0) return rc;
    rc = io_uring_register_eventfd(&ctx->ring, ctx->done_fd);
    if (rc < 0) {
        io_uring_queue_exit(&ctx->ring);
        return rc;
    }
    return 0;
}

static int uring_submit(so_aio_ctx *ctx)
{
    for (int b = 0; b < ctx->queue_depth; b++) {
        so_aio_block *blk = &ctx->blocks[b];
        if (blk->state != SO_BLOCK_READY) continue;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&ctx->ring);
        if (sqe == NULL) break;  /* the queue is full; the rest goes at the next call */
        if (ctx->slots[blk->slot].req.is_write)
            io_uring_prep_write(sqe, blk->fd, blk->addr, (unsigned)blk->len,
                                (uint64_t)blk->offset);
        else
            io_uring_prep_read(sqe, blk->fd, blk->addr, (unsigned)blk->len,
                               (uint64_t)blk->offset);
        io_uring_sqe_set_data(sqe, (void *)(intptr_t)b);
        blk->state = SO_BLOCK_IN_FLIGHT;
        ctx->in_flight++;
    }
    /* A bad operation fails on its own completion, not here; the kernel may still stop
     * early (out of memory), so submit until the queue is empty or it refuses. */
    while (io_uring_sq_ready(&ctx->ring) > 0) {
        int rc = io_uring_submit(&ctx->ring);
        if (rc == -EINTR) continue;
        if (rc == -EAGAIN || rc == -EBUSY) {
            /* retried after the next completion; with nothing in flight there is none */
            if (ctx->in_flight > (int)io_uring_sq_ready(&ctx->ring)) return 0;
            return rc;
        }
        if (rc < 0) return rc;
        if (rc == 0) break;
    }
    return 0;
}

static int uring_reap(so_aio_ctx *ctx)
{
    int n = 0;
    struct io_uring_cqe *cqe;
    while (io_uring_peek_cqe(&ctx->ring, &cqe) == 0) {
        int b = (int)(intptr_t)io_uring_cqe_get_data(cqe);
        int64_t res = cqe->res;
        io_uring_cqe_seen(&ctx->ring, cqe);
        so_aio_block_done(ctx, b, res);
        n++;
    }
    return n;
}
#endif

#ifdef SO_AIO_HAVE_LIBAIO
static int libaio_open(so_aio_ctx *ctx)
{
    ctx->iocb_list = calloc((size_t)ctx->queue_depth, sizeof *ctx->iocb_list);
    ctx->events = calloc((size_t)ctx->queue_depth, sizeof *ctx->events);
    if (ctx->iocb_list == NULL || ctx->events == NULL) {
        free(ctx->iocb_list);
        free(ctx->events);
        return -ENOMEM;
    }
    int rc = io_setup((unsigned)ctx->queue_depth, &ctx->aio);  /* libaio returns -errno */
    if (rc < 0) {
        free(ctx->iocb_list);
        free(ctx->events);
        return rc;
    }
    return 0;
}

static int libaio_submit(so_aio_ctx *ctx)
{
    int n = 0;
    int index[4096];
    for (int b = 0; b < ctx->queue_depth; b++) {
        so_aio_block *blk = &ctx->blocks[b];
        if (blk->state != SO_BLOCK_READY) continue;
        if (ctx->slots[blk->slot].req.is_write)
            io_prep_pwrite(&blk->iocb, blk->fd, blk->addr, (size_t)blk->len, blk->offset);
        else
            io_prep_pread(&blk->iocb, blk->fd, blk->addr, (size_t)blk->len, blk->offset);
        io_set_eventfd(&blk->iocb, ctx->done_fd);
        blk->iocb.data = (void *)(intptr_t)b;
        ctx->iocb_list[n] = &blk->iocb;
        index[n++] = b;
    }
    int first = 0;
    while (first < n) {
        int rc = io_submit(ctx->aio, n - first, ctx->iocb_list + first);
        if (rc == -EINTR) continue;
        if (rc == -EAGAIN) {
            /* out of kernel resources: the rest waits for a completion, if one will come */
            return ctx->in_flight > 0 ? 0 : rc;
        }
        if (rc < 0) {
            /* the first operation was refused (a bad descriptor): it fails alone */
            ctx->blocks[index[first]].state = SO_BLOCK_IN_FLIGHT;
            ctx->in_flight++;
            so_aio_block_done(ctx, index[first], rc);
            first++;
            continue;
        }
        for (int i = first; i < first + rc; i++) {
            ctx->blocks[index[i]].state = SO_BLOCK_IN_FLIGHT;
            ctx->in_flight++;
        }
        first += rc;
    }
    return 0;
}

static int libaio_reap(so_aio_ctx *ctx)
{
    struct timespec zero = {0, 0};
    int total = 0;
    for (;;) {
        int n = io_getevents(ctx->aio, 0, ctx->queue_depth, ctx->events, &zero);
        if (n == -EINTR) continue;
        if (n < 0) return n;
        for (int i = 0; i < n; i++) {
            /* res is the byte count or -errno, carried in an unsigned long */
            int64_t res = (int64_t)(long)ctx->events[i].res;
            so_aio_block_done(ctx, (int)(intptr_t)ctx->events[i].data, res);
        }
        total += n;
        if (n < ctx->queue_depth) return total;
    }
}
#endif

int so_aio_backend_open(so_aio_ctx *ctx)
{
#ifdef SO_AIO_HAVE_URING
    if (ctx->backend == SO_AIO_IO_URING) return uring_open(ctx);
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    if (ctx->backend == SO_AIO_LIBAIO) return libaio_open(ctx);
#endif
    return SO_AIO_ERR_BACKEND;
}

void so_aio_backend_close(so_aio_ctx *ctx)
{
#ifdef SO_AIO_HAVE_URING
    if (ctx->backend == SO_AIO_IO_URING) io_uring_queue_exit(&ctx->ring);
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    if (ctx->backend == SO_AIO_LIBAIO) {
        io_destroy(ctx->aio);  /* waits for whatever is still in flight */
        free(ctx->iocb_list);
        free(ctx->events);
    }
#endif
    (void)ctx;
}

int so_aio_backend_submit(so_aio_ctx *ctx)
{
#ifdef SO_AIO_HAVE_URING
    if (ctx->backend == SO_AIO_IO_URING) return uring_submit(ctx);
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    if (ctx->backend == SO_AIO_LIBAIO) return libaio_submit(ctx);
#endif
    return SO_AIO_ERR_BACKEND;
}

int so_aio_backend_reap(so_aio_ctx *ctx)
{
#ifdef SO_AIO_HAVE_URING
    if (ctx->backend == SO_AIO_IO_URING) return uring_reap(ctx);
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    if (ctx->backend == SO_AIO_LIBAIO) return libaio_reap(ctx);
#endif
    return SO_AIO_ERR_BACKEND;
}
