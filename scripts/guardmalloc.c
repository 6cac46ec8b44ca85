/* guardmalloc: a use-after-free and overrun trap for the large blocks of a process (LD_PRELOAD).
 *
 * Every allocation of at least GUARDMALLOC_MIN bytes (default 65536) gets a mapping of its own,
 * placed so that the block ends at most 127 bytes before a page that is never readable or
 * writable (an overrun faults once it reaches that page). When it is freed, its pages go back to the
 * kernel and the mapping stays, unreadable and unwritable, in a quarantine of the last
 * GUARDMALLOC_QUARANTINE frees (default 4096): a late write into it (a message received into a
 * buffer already given back) faults at once, in the writing thread, instead of landing on
 * whatever memory is given out next; a `recv` into it fails with EFAULT. On a fault this prints
 * the address, the freed block it falls in, the stack of the thread that freed it and the stack
 * of the thread that faulted, then lets the process die as it would have.
 *
 * What a guard page cannot catch, canaries do, checked when the block is freed: the bytes between
 * the block's end and the guard page (under 128) and the 16 bytes just before its start hold a
 * pattern, and the header before those carries a checksum of itself. A write past the end that
 * stops short of the guard page, or up to 56 bytes before the start (an underrun: where glibc keeps
 * the chunk header its free reads), is reported with the block and the freeing stack, and aborts.
 * GUARDMALLOC_FRAMES (default 24) is how many frames of the freeing stack each free records; 0
 * records none, for a free as fast as the trap allows (a race between a free and a late write
 * depends on timing, and a backtrace per free changes it).
 *
 * Smaller blocks go to glibc's own malloc. glibc's MALLOC_CHECK_ (libc_malloc_debug.so) does not
 * reach a Python process on this machine (docs/heap-corruption.md); this does.
 *
 *   gcc -O2 -shared -fPIC -o /tmp/guardmalloc.so scripts/guardmalloc.c -lpthread
 *   LD_PRELOAD=/tmp/guardmalloc.so python -m pytest tests/test_features.py
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

#define MAGIC 0x6775617264626c6bULL /* "guardblk" */
#define FRAMES 24
#define CANARY 0xa5 /* the pattern around each block */

struct header { /* the 64 bytes just before the block */
    uint64_t magic;
    char *base;
    size_t maplen;
    size_t size;
    uint64_t magic2;
    uint64_t check; /* MAGIC ^ base ^ maplen ^ size: the fields above as written */
    unsigned char before[16]; /* canary: an underrun of up to 16 bytes lands here */
};

struct freed {
    char *base;
    size_t maplen;
    size_t size;
    pid_t tid;
    int nframes;
    void *frames[FRAMES];
};

static size_t min_size = 65536, page = 4096, qcap = 4096, nframes = FRAMES;
static struct freed *quarantine;
static size_t qnext, qcount;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous_segv, previous_bus;

static int ours(void *p) {
    /* A block of ours starts 64 bytes or more into its page (guard_alloc sees to it), so its
     * header is on the block's own page; a pointer nearer its page's start (glibc's own mapped
     * chunks start 16 bytes in) is never ours, and nothing before its page is read. */
    if (p == NULL || ((uintptr_t)p & 63) != 0 || ((uintptr_t)p & (page - 1)) < 64) return 0;
    const struct header *h = (const struct header *)p - 1;
    return h->magic2 == MAGIC && h->magic == MAGIC;
}

static void *guard_alloc(size_t size, size_t align) { /* fresh anonymous pages are zero: calloc's too */
    if (align < 64) align = 64;
    size_t need = size + sizeof(struct header) + 2 * align;
    size_t data = (need + page - 1) & ~(page - 1);
    size_t maplen = data + page;
    char *base = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    mprotect(base + data, page, PROT_NONE);
    uintptr_t end = (uintptr_t)(base + data);
    uintptr_t p = (end - size) & ~(uintptr_t)(align - 1);
    if ((p & (page - 1)) < 64) p -= align; /* see `ours`: now 64 bytes or more into its page */
    struct header *h = (struct header *)p - 1;
    h->magic = MAGIC;
    h->magic2 = MAGIC;
    h->base = base;
    h->maplen = maplen;
    h->size = size;
    h->check = MAGIC ^ (uint64_t)(uintptr_t)base ^ maplen ^ size;
    memset(h->before, CANARY, sizeof h->before);
    memset((char *)p + size, CANARY, (size_t)(end - (p + size))); /* the tail, up to the guard page */
    return (void *)p;
}

/* A block of ours whose header's second magic was overwritten (an underrun of 25 to 32 bytes);
 * one that reaches the first magic too is beyond telling, and glibc's free will refuse it. */
static int overwritten(void *p) {
    if (p == NULL || ((uintptr_t)p & 63) != 0 || ((uintptr_t)p & (page - 1)) < 64) return 0;
    const struct header *h = (const struct header *)p - 1;
    return h->magic == MAGIC && h->magic2 != MAGIC;
}

/* A canary found changed: say where and what, with the freeing stack, and abort. */
static void report_canary(const struct header *h, int past_end, size_t offset, unsigned char found) {
    char msg[320];
    int n = snprintf(msg, sizeof msg,
                     "\nguardmalloc: a write %s a block of %zu bytes at %p (the byte at %s%zu from its %s reads 0x%02x), found at its free in thread %d:\n",
                     past_end ? "past the end of" : "before the start of", h->size, (void *)(h + 1), past_end ? "+" : "-", offset,
                     past_end ? "end" : "start", found, gettid());
    write(2, msg, n);
    void *frames[FRAMES];
    backtrace_symbols_fd(frames, backtrace(frames, FRAMES), 2);
    abort();
}

static void check_canaries(const struct header *h) {
    const unsigned char *p = (const unsigned char *)(h + 1);
    if (h->check != (MAGIC ^ (uint64_t)(uintptr_t)h->base ^ h->maplen ^ h->size)) {
        char msg[200];
        int n = snprintf(msg, sizeof msg, "\nguardmalloc: the header before the block at %p was overwritten (a write before its start), found at its free in thread %d:\n",
                         (void *)p, gettid());
        write(2, msg, n);
        void *frames[FRAMES];
        backtrace_symbols_fd(frames, backtrace(frames, FRAMES), 2);
        abort();
    }
    for (size_t i = 0; i < sizeof h->before; i++)
        if (h->before[i] != CANARY) report_canary(h, 0, sizeof h->before - i, h->before[i]);
    const unsigned char *end = (const unsigned char *)(h->base + h->maplen - page);
    for (const unsigned char *q = p + h->size; q < end; q++)
        if (*q != CANARY) report_canary(h, 1, (size_t)(q - (p + h->size)), *q);
}

static void guard_free(void *p) {
    struct header *h = (struct header *)p - 1;
    char *base = h->base;
    size_t maplen = h->maplen, size = h->size;
    check_canaries(h);
    h->magic = h->magic2 = 0;
    madvise(base, maplen, MADV_DONTNEED);
    mprotect(base, maplen, PROT_NONE);
    pthread_mutex_lock(&lock);
    if (quarantine == NULL) {
        quarantine = mmap(NULL, qcap * sizeof(struct freed), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (quarantine == MAP_FAILED) {
            quarantine = NULL;
            pthread_mutex_unlock(&lock);
            munmap(base, maplen);
            return;
        }
    }
    struct freed *q = &quarantine[qnext];
    if (qcount == qcap) munmap(q->base, q->maplen);
    else qcount++;
    q->base = base;
    q->maplen = maplen;
    q->size = size;
    q->tid = gettid();
    q->nframes = nframes ? backtrace(q->frames, (int)nframes) : 0;
    qnext = (qnext + 1) % qcap;
    pthread_mutex_unlock(&lock);
}

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    char *addr = info->si_addr;
    char msg[256];
    int n = snprintf(msg, sizeof msg, "\nguardmalloc: %s at %p in thread %d of pid %d\n", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", addr,
                     gettid(), getpid());
    write(2, msg, n);
    for (size_t i = 0; quarantine != NULL && i < qcount; i++) {
        struct freed *q = &quarantine[i];
        if (addr >= q->base && addr < q->base + q->maplen) {
            n = snprintf(msg, sizeof msg, "guardmalloc: inside a FREED block of %zu bytes (mapping %p + %zu), freed by thread %d at:\n", q->size,
                         q->base, q->maplen, q->tid);
            write(2, msg, n);
            backtrace_symbols_fd(q->frames, q->nframes, 2);
        }
    }
    write(2, "guardmalloc: the faulting thread:\n", 34);
    void *frames[FRAMES];
    backtrace_symbols_fd(frames, backtrace(frames, FRAMES), 2);
    struct sigaction *prev = sig == SIGSEGV ? &previous_segv : &previous_bus;
    sigaction(sig, prev, NULL); /* the previous handler (or the default) runs when the fault repeats */
    (void)ctx;
}

static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }

__attribute__((constructor)) static void init(void) {
    const char *s = getenv("GUARDMALLOC_MIN");
    if (s) min_size = strtoull(s, NULL, 10);
    s = getenv("GUARDMALLOC_QUARANTINE");
    if (s && strtoull(s, NULL, 10) > 0) qcap = strtoull(s, NULL, 10);
    s = getenv("GUARDMALLOC_FRAMES");
    if (s) nframes = strtoull(s, NULL, 10) < FRAMES ? strtoull(s, NULL, 10) : FRAMES;
    page = (size_t)sysconf(_SC_PAGESIZE);
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc before any fault or lock */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
    pthread_atfork(before_fork, after_fork, after_fork);
}

void *malloc(size_t n) { return n >= min_size ? guard_alloc(n, 64) : __libc_malloc(n); }

void *calloc(size_t k, size_t n) {
    size_t t;
    if (__builtin_mul_overflow(k, n, &t)) {
        errno = ENOMEM;
        return NULL;
    }
    return t >= min_size ? guard_alloc(t, 64) : __libc_calloc(k, n);
}

void free(void *p) {
    if (ours(p)) guard_free(p);
    else if (overwritten(p)) report_canary((const struct header *)p - 1, 0, 32, (unsigned char)((const struct header *)p - 1)->magic2);
    else __libc_free(p);
}

void cfree(void *p) { free(p); }

void *realloc(void *p, size_t n) {
    if (!ours(p)) {
        if (p != NULL && n >= min_size) {
            size_t old = malloc_usable_size(p);
            void *q = guard_alloc(n, 64);
            if (q == NULL) return NULL;
            memcpy(q, p, old < n ? old : n);
            __libc_free(p);
            return q;
        }
        return p == NULL ? malloc(n) : __libc_realloc(p, n);
    }
    if (n == 0) {
        guard_free(p);
        return NULL;
    }
    size_t old = ((struct header *)p - 1)->size;
    void *q = malloc(n);
    if (q == NULL) return NULL;
    memcpy(q, p, old < n ? old : n);
    guard_free(p);
    return q;
}

/* Alignments above 2 KiB (pages) stay with glibc: a block of ours never starts its page. */
void *memalign(size_t align, size_t n) { return n >= min_size && align <= 2048 ? guard_alloc(n, align) : __libc_memalign(align, n); }
void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
void *valloc(size_t n) { return memalign(page, n); }
void *pvalloc(size_t n) { return memalign(page, (n + page - 1) & ~(page - 1)); }

int posix_memalign(void **out, size_t align, size_t n) {
    if (align < sizeof(void *) || (align & (align - 1)) != 0) return EINVAL;
    void *p = memalign(align, n);
    if (p == NULL) return ENOMEM;
    *out = p;
    return 0;
}

size_t malloc_usable_size(void *p) {
    static size_t (*real)(void *);
    if (ours(p)) return ((struct header *)p - 1)->size;
    if (real == NULL) real = (size_t(*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    return real(p);
}
