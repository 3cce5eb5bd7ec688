/* superoffload asynchronous file I/O: the ring's private layout, shared by the request
 * logic (so_aio.c) and the kernel interfaces (so_aio_backends.c). Not part of the CDEF
 * block: Python never sees these structures.
 *
 * A request occupies a slot; a block is one kernel operation. A block is FREE, READY
 * (carved from a request, waiting to be handed to the kernel) or IN_FLIGHT (the kernel
 * has it). A short transfer sends the block's remainder back to READY.
 */
#ifndef SO_AIO_INTERNAL_H
#define SO_AIO_INTERNAL_H

#include "so_aio.h"

#ifdef SO_AIO_HAVE_URING
#include <liburing.h>
#endif
#ifdef SO_AIO_HAVE_LIBAIO
#include <libaio.h>
#endif

enum { SO_BLOCK_FREE = 0, SO_BLOCK_READY = 1, SO_BLOCK_IN_FLIGHT = 2 };

typedef struct so_aio_block {
    int state;
    int slot;           /* the request it belongs to */
    int fd;             /* O_DIRECT or buffered descriptor, chosen per block */
    char *addr;
    int64_t offset;     /* in the file */
    int64_t len;        /* bytes left to transfer */
#ifdef SO_AIO_HAVE_LIBAIO
    struct iocb iocb;
#endif
} so_aio_block;

typedef struct so_aio_slot {
    int used;
    so_aio_request req;
    int64_t issued;         /* bytes of the request already carved into blocks */
    int blocks;             /* its blocks not FREE */
    int64_t done_bytes;
    int32_t error;          /* first failure, 0 while none */
    int64_t error_offset;
} so_aio_slot;

struct so_aio_ctx {
    int backend;
    int queue_depth;
    int max_requests;
    int64_t block_bytes;
    int64_t align_bytes;
    so_aio_slot *slots;
    so_aio_block *blocks;
    int *free_blocks;       /* stack of FREE block indices */
    int n_free_blocks;
    int next_slot;          /* round-robin cursor: the next request to carve a block from */
    int in_flight;          /* blocks IN_FLIGHT */
    int pending;            /* requests submitted, not yet reported */
    int done_fd;            /* eventfd the kernel signals on each completion */
    int wake_fd;            /* eventfd so_aio_wake signals */
#ifdef SO_AIO_HAVE_URING
    struct io_uring ring;
#endif
#ifdef SO_AIO_HAVE_LIBAIO
    io_context_t aio;
    struct iocb **iocb_list;
    struct io_event *events;
#endif
};

/* so_aio_backends.c: the kernel interface of ctx->backend */
int so_aio_backend_open(so_aio_ctx *ctx);      /* 0 or -errno */
void so_aio_backend_close(so_aio_ctx *ctx);    /* after every block came back */
int so_aio_backend_submit(so_aio_ctx *ctx);    /* READY -> IN_FLIGHT; 0 or -errno */
int so_aio_backend_reap(so_aio_ctx *ctx);      /* completions available now; count or -errno */

/* so_aio.c: the backend reports one finished kernel operation (res: bytes or -errno) */
void so_aio_block_done(so_aio_ctx *ctx, int block, int64_t res);

#endif /* SO_AIO_INTERNAL_H */
