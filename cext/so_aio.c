/* superoffload asynchronous file I/O: requests, blocks and the run loop (cext/so_aio.h).
 *
 * Backend-independent: how a request is cut into blocks, which descriptor each block uses,
 * what a completion means (short transfers, end of file, errors), and when a request is
 * finished. The kernel interfaces live in so_aio_backends.c.
 */
#define _GNU_SOURCE
#include "so_aio_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int so_aio_abi_version(void) { return SO_AIO_ABI_VERSION; }

int so_aio_backends_built(void)
{
    int mask = 0;
#ifdef SO_AIO_HAVE_URING
    mask |= SO_AIO_IO_URING;
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    mask |= SO_AIO_LIBAIO;
#endif
    return mask;
}

static void free_ctx(so_aio_ctx *ctx)
{
    if (ctx->done_fd >= 0) close(ctx->done_fd);
    if (ctx->wake_fd >= 0) close(ctx->wake_fd);
    free(ctx->slots);
    free(ctx->blocks);
    free(ctx->free_blocks);
    free(ctx);
}

int so_aio_create(int backend, int queue_depth, int max_requests, int64_t block_bytes,
                  int64_t align_bytes, so_aio_ctx **out)
{
    if (out == NULL) return SO_AIO_ERR_ARG;
    *out = NULL;
    /* io_uring_prep_read takes an unsigned length: keep a block under 2 GiB */
    if (queue_depth < 1 || queue_depth > 4096 || max_requests < 1 || max_requests > 65536 ||
        align_bytes < 512 || (align_bytes & (align_bytes - 1)) != 0 ||
        block_bytes < align_bytes || block_bytes > ((int64_t)1 << 30) ||
        block_bytes % align_bytes != 0)
        return SO_AIO_ERR_ARG;
    if ((backend != SO_AIO_IO_URING && backend != SO_AIO_LIBAIO) ||
        (so_aio_backends_built() & backend) == 0)
        return SO_AIO_ERR_BACKEND;
    so_aio_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) return -ENOMEM;
    ctx->backend = backend;
    ctx->queue_depth = queue_depth;
    ctx->max_requests = max_requests;
    ctx->block_bytes = block_bytes;
    ctx->align_bytes = align_bytes;
    ctx->done_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    ctx->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    ctx->slots = calloc((size_t)max_requests, sizeof *ctx->slots);
    ctx->blocks = calloc((size_t)queue_depth, sizeof *ctx->blocks);
    ctx->free_blocks = calloc((size_t)queue_depth, sizeof *ctx->free_blocks);
    if (ctx->done_fd < 0 || ctx->wake_fd < 0) {
        int err = errno;
        free_ctx(ctx);
        return -err;
    }
    if (ctx->slots == NULL || ctx->blocks == NULL || ctx->free_blocks == NULL) {
        free_ctx(ctx);
        return -ENOMEM;
    }
    for (int b = 0; b < queue_depth; b++) ctx->free_blocks[b] = queue_depth - 1 - b;
    ctx->n_free_blocks = queue_depth;
    int rc = so_aio_backend_open(ctx);
    if (rc < 0) {
        free_ctx(ctx);
        return rc;
    }
    *out = ctx;
    return 0;
}

int so_aio_submit(so_aio_ctx *ctx, const so_aio_request *req)
{
    if (ctx == NULL || req == NULL || req->offset < 0 || req->nbytes < 0 ||
        req->fd_buffered < 0 || (req->nbytes > 0 && req->buf == NULL) ||
        (req->is_write != 0 && req->is_write != 1))
        return SO_AIO_ERR_ARG;
    for (int s = 0; s < ctx->max_requests; s++) {
        so_aio_slot *slot = &ctx->slots[s];
        if (slot->used) continue;
        memset(slot, 0, sizeof *slot);
        slot->used = 1;
        slot->req = *req;
        slot->error_offset = -1;
        ctx->pending++;
        return 0;
    }
    return SO_AIO_ERR_FULL;
}

int so_aio_wake(so_aio_ctx *ctx)
{
    if (ctx == NULL) return SO_AIO_ERR_ARG;
    uint64_t one = 1;
    /* EAGAIN: the counter is already non-zero, so a wake-up is pending anyway */
    if (write(ctx->wake_fd, &one, sizeof one) < 0 && errno != EAGAIN) return -errno;
    return 0;
}

int so_aio_pending(const so_aio_ctx *ctx) { return ctx == NULL ? 0 : ctx->pending; }

/* O_DIRECT needs the file offset, the memory address and the length aligned; anything
 * else (a request's unaligned head or tail, a buffer torch placed anywhere) goes through
 * the page cache, so every request works and aligned ones run at the device's speed. */
static void choose_fd(const so_aio_ctx *ctx, so_aio_block *blk)
{
    const so_aio_request *req = &ctx->slots[blk->slot].req;
    int64_t a = ctx->align_bytes;
    int direct = req->fd_direct >= 0 && blk->offset % a == 0 &&
                 (uintptr_t)blk->addr % (uintptr_t)a == 0 && blk->len % a == 0;
    blk->fd = direct ? req->fd_direct : req->fd_buffered;
}

static void carve(so_aio_ctx *ctx, int s)
{
    so_aio_slot *slot = &ctx->slots[s];
    int b = ctx->free_blocks[--ctx->n_free_blocks];
    so_aio_block *blk = &ctx->blocks[b];
    int64_t a = ctx->align_bytes;
    int64_t left = slot->req.nbytes - slot->issued;
    int64_t offset = slot->req.offset + slot->issued;
    int64_t len;
    if (offset % a != 0) {
        /* the head, up to the first aligned offset: every later block starts aligned */
        len = a - offset % a;
        if (len > left) len = left;
    } else {
        len = left < ctx->block_bytes ? left : ctx->block_bytes;
        /* keep the tail under one alignment unit in a block of its own */
        if (len > a) len -= len % a;
    }
    blk->state = SO_BLOCK_READY;
    blk->slot = s;
    blk->addr = (char *)slot->req.buf + slot->issued;
    blk->offset = offset;
    blk->len = len;
    choose_fd(ctx, blk);
    slot->issued += len;
    slot->blocks++;
}

/* Carve blocks until queue_depth are busy, one block per unfinished request in turn
 * (round robin), so a small read is not queued behind a large write-back. */
static void fill(so_aio_ctx *ctx)
{
    while (ctx->n_free_blocks > 0) {
        int found = -1;
        for (int i = 0; i < ctx->max_requests; i++) {
            int s = (ctx->next_slot + i) % ctx->max_requests;
            const so_aio_slot *slot = &ctx->slots[s];
            if (slot->used && slot->error == 0 && slot->issued < slot->req.nbytes) {
                found = s;
                break;
            }
        }
        if (found < 0) return;
        carve(ctx, found);
        ctx->next_slot = (found + 1) % ctx->max_requests;
    }
}

static void release(so_aio_ctx *ctx, int b)
{
    so_aio_block *blk = &ctx->blocks[b];
    ctx->slots[blk->slot].blocks--;
    blk->state = SO_BLOCK_FREE;
    ctx->free_blocks[ctx->n_free_blocks++] = b;
}

static void fail(so_aio_slot *slot, int32_t error, int64_t offset)
{
    /* the failure nearest the start of the request is the one reported: where a
     * truncated file ends, not whichever block came back first */
    if (slot->error == 0 || (offset >= 0 && offset < slot->error_offset)) {
        slot->error = error;
        slot->error_offset = offset;
    }
}

void so_aio_block_done(so_aio_ctx *ctx, int b, int64_t res)
{
    so_aio_block *blk = &ctx->blocks[b];
    so_aio_slot *slot = &ctx->slots[blk->slot];
    ctx->in_flight--;
    if (res == -EAGAIN || res == -EINTR) {  /* nothing happened: issue it again */
        blk->state = SO_BLOCK_READY;
        return;
    }
    if (res <= 0) {
        /* 0 bytes: a read at the end of the file (truncated under us), never zeros */
        int32_t error = res < 0 ? (int32_t)res
                        : slot->req.is_write ? SO_AIO_ERR_ZERO_WRITE : SO_AIO_ERR_EOF;
        fail(slot, error, blk->offset);
        release(ctx, b);
        return;
    }
    if (res > blk->len) res = blk->len;  /* never count more than was asked */
    slot->done_bytes += res;
    blk->addr += res;
    blk->offset += res;
    blk->len -= res;
    if (blk->len > 0) {
        /* a short transfer: issue the rest, buffered if it is no longer aligned (even
         * after another block failed: a read that ends here says where the file ends) */
        choose_fd(ctx, blk);
        blk->state = SO_BLOCK_READY;
        return;
    }
    release(ctx, b);
}

/* Report finished requests: every block back, and either every byte carved or a failure. */
static int emit(so_aio_ctx *ctx, so_aio_completion *out, int max_out)
{
    int n = 0;
    for (int s = 0; s < ctx->max_requests && n < max_out; s++) {
        so_aio_slot *slot = &ctx->slots[s];
        if (!slot->used || slot->blocks > 0) continue;
        if (slot->error == 0 && slot->issued < slot->req.nbytes) continue;
        out[n].tag = slot->req.tag;
        out[n].done_bytes = slot->done_bytes;
        out[n].error = slot->error;
        out[n].error_offset = slot->error_offset;
        n++;
        slot->used = 0;
        ctx->pending--;
    }
    return n;
}

static void drain(int fd)
{
    uint64_t count;
    while (read(fd, &count, sizeof count) > 0) {
    }
}

int so_aio_run(so_aio_ctx *ctx, int timeout_ms, so_aio_completion *out, int max_out)
{
    if (ctx == NULL || max_out < 1 || out == NULL) return SO_AIO_ERR_ARG;
    int woken = 0;
    for (;;) {
        int rc = so_aio_backend_reap(ctx);
        if (rc < 0) return rc;
        fill(ctx);
        rc = so_aio_backend_submit(ctx);
        if (rc < 0) return rc;
        int n = emit(ctx, out, max_out);
        if (n > 0 || woken || ctx->in_flight == 0) return n;
        struct pollfd fds[2] = {{.fd = ctx->done_fd, .events = POLLIN},
                                {.fd = ctx->wake_fd, .events = POLLIN}};
        rc = poll(fds, 2, timeout_ms);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) return -errno;
        if (rc == 0) return 0;  /* timed out */
        /* drain before reaping: a completion posted after the reap signals again */
        if (fds[0].revents & POLLIN) drain(ctx->done_fd);
        if (fds[1].revents & POLLIN) {
            drain(ctx->wake_fd);
            woken = 1;
        }
    }
}

void so_aio_destroy(so_aio_ctx *ctx)
{
    if (ctx == NULL) return;
    /* The kernel may still be writing into the caller's buffers: wait for every block in
     * flight, issuing nothing more (a cancelled request's remainder is dropped). */
    for (int s = 0; s < ctx->max_requests; s++)
        if (ctx->slots[s].used && ctx->slots[s].error == 0) ctx->slots[s].error = -ECANCELED;
    while (ctx->in_flight > 0) {
        if (so_aio_backend_reap(ctx) < 0) break;
        if (ctx->in_flight == 0) break;
        struct pollfd fd = {.fd = ctx->done_fd, .events = POLLIN};
        if (poll(&fd, 1, -1) < 0 && errno != EINTR) break;
        drain(ctx->done_fd);
    }
    so_aio_backend_close(ctx);
    free_ctx(ctx);
}
