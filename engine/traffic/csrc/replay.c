/* Instant replay of a trace through a pool of blocks, as engine/kv/pool.py and engine/kv/manager.py run it, in C.
 *
 * Why: a capacity sweep replays the whole trace once per policy and size; the engine does it at ~1 ms a request
 * (Python per block), this at well under a microsecond a block. It is the engine's own rules written again, not a
 * model of them, and tests/test_traffic_sweep.py replays the same trace through both and compares every eviction
 * (block id, content, request), so the two cannot drift apart unseen.
 *
 * The rules (one request at a time, in trace order; nodes are prefix nodes: equal exactly when the engine's chained
 * hashes are equal):
 *   - hits: the longest leading run of nodes the pool holds; all of them (a replayed request samples nothing);
 *   - content past the first miss that the pool holds is looked up (Belady re-ranks it) and protected from
 *     eviction while the request takes its blocks, if the request still fits beside it;
 *   - hit blocks leave the cached set; the request then takes one block per remaining node: a plain free block
 *     first (oldest freed first), else the policy's victim;
 *   - each new block is registered for its node unless another block holds that node already;
 *   - the request ends: its blocks are released last first; a registered one becomes cached (LRU: queue tail),
 *     the others free (free queue tail).
 * Policies: 0 LRU (release order), 1 FIFO (store order), 2 Belady (furthest next lookup, then oldest release),
 * 3 S3-FIFO and 4 S3-LRU (engine/kv/policies/s3fifo.py: a small probation queue, a main queue, a ghost ring of
 * contents evicted from the small one; S3-LRU's main queue takes a block used again to its tail).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FREE = 0, USED = 1, CACHED = 2 };
enum { LRU = 0, FIFO = 1, BELADY = 2, S3FIFO = 3, S3LRU = 4 };
enum { NONE = 0, SMALL = 1, MAIN = 2 };
enum { HIT = 0, COLD = 1, EVICTED = 2, AFTER_BREAK = 3 };

typedef struct { int64_t key, stamp; int64_t block; } entry;

typedef struct {
    entry *items;
    int64_t size, cap;
    int max_first; /* 1: larger key first (Belady); 0: smaller key first (FIFO); then smaller stamp */
} heap;

static int before(const heap *h, const entry *a, const entry *b) {
    if (a->key != b->key) return h->max_first ? a->key > b->key : a->key < b->key;
    if (a->stamp != b->stamp) return a->stamp < b->stamp;
    return a->block < b->block;
}

static int heap_push(heap *h, entry e) {
    if (h->size == h->cap) {
        int64_t cap = h->cap ? 2 * h->cap : 1024;
        entry *items = realloc(h->items, (size_t)cap * sizeof(entry));
        if (!items) return -1;
        h->items = items;
        h->cap = cap;
    }
    int64_t i = h->size++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!before(h, &e, &h->items[p])) break;
        h->items[i] = h->items[p];
        i = p;
    }
    h->items[i] = e;
    return 0;
}

static entry heap_pop(heap *h) {
    entry top = h->items[0], last = h->items[--h->size];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= h->size) break;
        if (c + 1 < h->size && before(h, &h->items[c + 1], &h->items[c])) c++;
        if (!before(h, &h->items[c], &last)) break;
        h->items[i] = h->items[c];
        i = c;
    }
    if (h->size) h->items[i] = last;
    return top;
}

/* S3's two queues: doubly linked lists over blocks (a block is in at most one). */
typedef struct {
    int64_t *prev, *next, head[3], tail[3], len[3], evictable[3];
    int8_t *queue, *freq;
    int64_t *ghost, ghost_cap, ghost_at, *ghost_slot; /* ring of nodes; node -> its ring slot or -1 */
    int64_t small_target;
} s3;

typedef struct {
    int64_t n, policy;
    int8_t *state;
    int64_t *block_node, *node_block, *stamp, *stored, *key, *prev, *next, *freeq, *prot;
    int64_t free_head, free_count, head, tail, num_cached, release_clock, store_clock, prot_gen;
    int64_t *prot_list, prot_len; /* the blocks protected now (prot[b] == prot_gen) */
    heap h;
    s3 q;
} pool;

static void q_unlink(s3 *q, int64_t b) {
    int w = q->queue[b];
    int64_t pr = q->prev[b], nx = q->next[b];
    if (pr >= 0) q->next[pr] = nx; else q->head[w] = nx;
    if (nx >= 0) q->prev[nx] = pr; else q->tail[w] = pr;
    q->len[w]--;
    q->queue[b] = NONE;
}

/* Block b to the tail of queue w (out of the one it was in); ``cached``: it is evictable now. */
static void q_enter(s3 *q, int64_t b, int w, int cached) {
    if (q->queue[b] != NONE) {
        q->evictable[q->queue[b]] -= cached;
        q_unlink(q, b);
    }
    q->queue[b] = (int8_t)w;
    q->prev[b] = q->tail[w];
    q->next[b] = -1;
    if (q->tail[w] >= 0) q->next[q->tail[w]] = b; else q->head[w] = b;
    q->tail[w] = b;
    q->len[w]++;
    q->evictable[w] += cached;
}

static void ghost_remember(s3 *q, int64_t node) {
    int64_t at = q->ghost_at, old = q->ghost[at];
    if (old >= 0 && q->ghost_slot[old] == at) q->ghost_slot[old] = -1;
    q->ghost[at] = node;
    q->ghost_slot[node] = at;
    q->ghost_at = (at + 1) % q->ghost_cap;
}

static int s3_has_evictable(const pool *p, int w) {
    int64_t protected_here = 0;
    for (int64_t i = 0; i < p->prot_len; i++) {
        int64_t b = p->prot_list[i];
        if (p->prot[b] == p->prot_gen && p->q.queue[b] == w && p->state[b] == CACHED) protected_here++;
    }
    return p->q.evictable[w] > protected_here;
}

static void lru_unlink(pool *p, int64_t b) {
    int64_t pr = p->prev[b], nx = p->next[b];
    if (pr >= 0) p->next[pr] = nx; else p->head = nx;
    if (nx >= 0) p->prev[nx] = pr; else p->tail = pr;
}

static void lru_append(pool *p, int64_t b) {
    p->prev[b] = p->tail;
    p->next[b] = -1;
    if (p->tail >= 0) p->next[p->tail] = b; else p->head = b;
    p->tail = b;
}

static int valid(const pool *p, const entry *e) {
    int64_t b = e->block;
    if (p->state[b] != CACHED || p->stamp[b] != e->stamp) return 0;
    return p->policy == FIFO ? p->stored[b] == e->key : p->key[b] == e->key;
}

/* S3's victim: the queues move as engine/kv/policies/s3fifo.py moves them. */
static int64_t s3_victim(pool *p) {
    s3 *q = &p->q;
    int lru = p->policy == S3LRU;
    for (int64_t guard = 0; guard < 8 * (p->n + 1); guard++) {
        int from_small = q->len[SMALL] >= q->small_target || !s3_has_evictable(p, MAIN);
        int w = from_small && s3_has_evictable(p, SMALL) ? SMALL : MAIN;
        int64_t b = q->head[w];
        while (b >= 0 && p->prot[b] == p->prot_gen) b = q->next[b];
        if (b < 0) return -1;
        if (p->state[b] != CACHED) { /* in use: it cannot go */
            q->freq[b] = 0;
            q_enter(q, b, MAIN, 0);
        } else if (q->freq[b] > 0 && (w == SMALL || !lru)) { /* hit since it entered: it stays, one hit spent */
            q->freq[b] = w == SMALL ? 0 : q->freq[b] - 1;
            q_enter(q, b, MAIN, 1);
        } else {
            if (w == SMALL) ghost_remember(q, p->block_node[b]);
            return b;
        }
    }
    return -1;
}

/* The block the policy evicts, never a protected one; -1 if none (callers make sure one exists). */
static int64_t victim(pool *p) {
    if (p->policy == S3FIFO || p->policy == S3LRU) return s3_victim(p);
    if (p->policy == LRU) {
        for (int64_t b = p->head; b >= 0; b = p->next[b])
            if (p->prot[b] != p->prot_gen) return b;
        return -1;
    }
    int64_t found = -1, nskip = 0;
    entry skipped[64];
    entry *more = NULL;
    int64_t more_n = 0, more_cap = 0;
    while (p->h.size) {
        entry top = p->h.items[0];
        if (!valid(p, &top)) { heap_pop(&p->h); continue; }
        if (p->prot[top.block] == p->prot_gen) {
            heap_pop(&p->h);
            if (nskip < 64) skipped[nskip++] = top;
            else {
                if (more_n == more_cap) {
                    more_cap = more_cap ? 2 * more_cap : 256;
                    entry *grown = realloc(more, (size_t)more_cap * sizeof(entry));
                    if (!grown) break;
                    more = grown;
                }
                more[more_n++] = top;
            }
            continue;
        }
        found = top.block;
        break;
    }
    for (int64_t i = 0; i < nskip; i++) heap_push(&p->h, skipped[i]);
    for (int64_t i = 0; i < more_n; i++) heap_push(&p->h, more[i]);
    free(more);
    return found;
}

/* Rebuild the heap from the cached blocks when stale entries pile up (keeps memory bounded). */
static int compact(pool *p) {
    if (p->policy == LRU || p->policy == S3FIFO || p->policy == S3LRU || p->h.size < 4 * p->n + 1024) return 0;
    p->h.size = 0;
    for (int64_t b = 0; b < p->n; b++)
        if (p->state[b] == CACHED) {
            entry e = {p->policy == FIFO ? p->stored[b] : p->key[b], p->stamp[b], b};
            if (heap_push(&p->h, e)) return -1;
        }
    return 0;
}

/* Returns 0, or -1 when memory ran out, -2 when a request could not be placed (the pool is smaller than it). */
int replay_instant(int64_t num_requests, const int64_t *offsets, const int64_t *nodes, int64_t num_nodes,
                   const int64_t *next_pos, int64_t num_blocks, int32_t policy, int64_t *hits, int8_t *outcome,
                   int64_t *evictions, int64_t max_evictions, int64_t *num_evictions) {
    pool p;
    memset(&p, 0, sizeof p);
    p.n = num_blocks;
    p.policy = policy;
    p.h.max_first = policy == BELADY;
    int64_t longest = 0;
    for (int64_t r = 0; r < num_requests; r++)
        if (offsets[r + 1] - offsets[r] > longest) longest = offsets[r + 1] - offsets[r];
    p.state = calloc((size_t)num_blocks, 1);
    p.block_node = malloc((size_t)num_blocks * sizeof(int64_t));
    p.node_block = malloc((size_t)(num_nodes ? num_nodes : 1) * sizeof(int64_t));
    p.stamp = calloc((size_t)num_blocks, sizeof(int64_t));
    p.stored = calloc((size_t)num_blocks, sizeof(int64_t));
    p.key = calloc((size_t)num_blocks, sizeof(int64_t));
    p.prev = malloc((size_t)num_blocks * sizeof(int64_t));
    p.next = malloc((size_t)num_blocks * sizeof(int64_t));
    p.freeq = malloc((size_t)num_blocks * sizeof(int64_t));
    p.prot = calloc((size_t)num_blocks, sizeof(int64_t));
    p.prot_list = malloc((size_t)(longest ? longest : 1) * sizeof(int64_t));
    int8_t *seen = calloc((size_t)(num_nodes ? num_nodes : 1), 1);
    int64_t *table = malloc((size_t)(longest ? longest : 1) * sizeof(int64_t));
    int rc = 0;
    int is_s3 = policy == S3FIFO || policy == S3LRU;
    if (is_s3) {
        s3 *q = &p.q;
        double share = policy == S3LRU ? 0.4 : 0.1, ghost = policy == S3LRU ? 2.0 : 0.9;
        q->small_target = (int64_t)(num_blocks * share);
        if (q->small_target < 1) q->small_target = 1;
        q->ghost_cap = (int64_t)(num_blocks * ghost);
        if (q->ghost_cap < 1) q->ghost_cap = 1;
        q->prev = malloc((size_t)num_blocks * sizeof(int64_t));
        q->next = malloc((size_t)num_blocks * sizeof(int64_t));
        q->queue = calloc((size_t)num_blocks, 1);
        q->freq = calloc((size_t)num_blocks, 1);
        q->ghost = malloc((size_t)q->ghost_cap * sizeof(int64_t));
        q->ghost_slot = malloc((size_t)(num_nodes ? num_nodes : 1) * sizeof(int64_t));
        if (!q->prev || !q->next || !q->queue || !q->freq || !q->ghost || !q->ghost_slot) { rc = -1; goto out; }
        for (int i = 0; i < 3; i++) q->head[i] = q->tail[i] = -1;
        for (int64_t i = 0; i < q->ghost_cap; i++) q->ghost[i] = -1;
        for (int64_t x = 0; x < num_nodes; x++) q->ghost_slot[x] = -1;
    }
    if (!p.state || !p.block_node || !p.node_block || !p.stamp || !p.stored || !p.key || !p.prev || !p.next ||
        !p.freeq || !p.prot || !p.prot_list || !seen || !table) { rc = -1; goto out; }
    for (int64_t b = 0; b < num_blocks; b++) { p.block_node[b] = -1; p.freeq[b] = b; }
    for (int64_t x = 0; x < num_nodes; x++) p.node_block[x] = -1;
    p.free_head = 0;
    p.free_count = num_blocks;
    p.head = p.tail = -1;
    *num_evictions = 0;

    for (int64_t r = 0; r < num_requests; r++) {
        const int64_t start = offsets[r], n = offsets[r + 1] - start;
        const int64_t *nd = nodes + start;
        int64_t k = 0;
        while (k < n && p.node_block[nd[k]] >= 0) k++;
        hits[r] = k;
        int64_t kept = 0;
        p.prot_gen++;
        p.prot_len = 0;
        for (int64_t j = 0; j < n; j++) {
            int64_t b = p.node_block[nd[j]];
            if (outcome) outcome[start + j] = j < k ? HIT : !seen[nd[j]] ? COLD : b >= 0 ? AFTER_BREAK : EVICTED;
            if (j >= k && b >= 0) { /* past the first miss, held: looked up, and protected if it fits */
                kept += p.state[b] == CACHED;
                p.prot[b] = p.prot_gen;
                p.prot_list[p.prot_len++] = b;
                if (p.policy == BELADY && p.state[b] == CACHED) {
                    p.key[b] = next_pos[start + j];
                    if (heap_push(&p.h, (entry){p.key[b], p.stamp[b], b})) { rc = -1; goto out; }
                }
            }
        }
        /* the request takes its hits back from the cached set, then n - k blocks */
        int64_t need = n - k;
        if (need + kept + k > p.free_count + p.num_cached) p.prot_gen++;  /* protection would not fit: dropped */
        for (int64_t j = 0; j < k; j++) {
            int64_t b = p.node_block[nd[j]];
            table[j] = b;
            if (p.state[b] == CACHED) {
                if (p.policy == LRU) lru_unlink(&p, b);
                p.num_cached--;
                if (is_s3) {
                    if (p.q.freq[b] < 3) p.q.freq[b]++;
                    if (p.q.queue[b] != NONE) p.q.evictable[p.q.queue[b]]--;
                }
            }
            p.state[b] = USED;
        }
        if (need > p.free_count + p.num_cached) { rc = -2; goto out; }
        for (int64_t j = k; j < n; j++) {
            int64_t b;
            if (p.free_count) {
                b = p.freeq[p.free_head];
                p.free_head = (p.free_head + 1) % num_blocks;
                p.free_count--;
            } else {
                b = victim(&p);
                if (b < 0) { rc = -2; goto out; }
                if (p.policy == LRU) lru_unlink(&p, b);
                p.num_cached--;
                if (is_s3 && p.q.queue[b] != NONE) {
                    p.q.evictable[p.q.queue[b]]--;
                    q_unlink(&p.q, b);
                }
                int64_t gone = p.block_node[b];
                if (evictions && *num_evictions < max_evictions) {
                    evictions[3 * *num_evictions] = r;
                    evictions[3 * *num_evictions + 1] = b;
                    evictions[3 * *num_evictions + 2] = gone;
                }
                (*num_evictions)++;
                p.node_block[gone] = -1;
                p.block_node[b] = -1;
            }
            p.state[b] = USED;
            table[j] = b;
        }
        for (int64_t j = k; j < n; j++) /* computed: registered unless another block holds the node */
            if (p.node_block[nd[j]] < 0) {
                p.node_block[nd[j]] = table[j];
                p.block_node[table[j]] = nd[j];
                p.stored[table[j]] = ++p.store_clock;
                if (is_s3) {
                    int64_t slot = p.q.ghost_slot[nd[j]];
                    if (slot >= 0) { p.q.ghost[slot] = -1; p.q.ghost_slot[nd[j]] = -1; }
                    p.q.freq[table[j]] = 0;
                    q_enter(&p.q, table[j], slot >= 0 ? MAIN : SMALL, 0);
                }
            }
        for (int64_t j = n - 1; j >= 0; j--) { /* finished: released last block first */
            int64_t b = table[j];
            p.stamp[b] = ++p.release_clock;
            seen[nd[j]] = 1;
            if (p.block_node[b] >= 0) {
                p.state[b] = CACHED;
                p.num_cached++;
                if (p.policy == LRU) lru_append(&p, b);
                else if (is_s3) {
                    int w = p.q.queue[b];
                    if (w != NONE) {
                        p.q.evictable[w]++;
                        if (w == MAIN && p.policy == S3LRU) q_enter(&p.q, b, MAIN, 1);
                    }
                } else {
                    if (p.policy == BELADY) p.key[b] = next_pos[start + j];
                    entry e = {p.policy == FIFO ? p.stored[b] : p.key[b], p.stamp[b], b};
                    if (heap_push(&p.h, e)) { rc = -1; goto out; }
                }
            } else {
                p.state[b] = FREE;
                p.freeq[(p.free_head + p.free_count) % num_blocks] = b;
                p.free_count++;
            }
        }
        if (compact(&p)) { rc = -1; goto out; }
    }
out:
    free(p.state); free(p.block_node); free(p.node_block); free(p.stamp); free(p.stored); free(p.key);
    free(p.prev); free(p.next); free(p.freeq); free(p.prot); free(p.prot_list); free(seen); free(table); free(p.h.items);
    free(p.q.prev); free(p.q.next); free(p.q.queue); free(p.q.freq); free(p.q.ghost); free(p.q.ghost_slot);
    return rc;
}
