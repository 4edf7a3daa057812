"""The indexer's scores on FP8 warpgroup MMA (sm_90a), in CuTe DSL.

One CTA of SCORE_WARPGROUPS warpgroups per ``span`` consecutive key tiles of a request b
(grid: ceil(tiles / span), B). It stages the request's query heads once for all its
warpgroups (T x G tiles of 64 heads x 128 bytes, 128-byte swizzled, K-major) and its weights;
then each warpgroup streams every SCORE_WARPGROUPS-th of the CTA's key tiles (64 tokens x 128
bytes, gathered through the block table by 16-byte cp.async, zero-filled where the block is
outside the cache) through its own ring of STAGES buffers, synchronised by its own named
barrier (the warpgroups overlap each other's waits and epilogues: twice the warps per SM for
the same staged queries). Per key tile, the (verify row t, head tile) units two at a time:
S = K Q^T by four wgmma m64n128k32 E4M3 (tokens as M, the pair's 128 heads as N, FP32
accumulators; an odd count's last unit m64n64k32), then per unit the epilogue sum_h w[t, h]
relu(S) in FP32 (16 heads per thread, then the quad's four lanes), times the token's key
scale. The result leaves as the score's order key (``order_key``): the top-k kernel selects on
those 32-bit keys, 0 meaning no candidate.

Hopper's FP8 wgmma adds the products of each k32 step with reduced precision before they
reach the FP32 accumulator (as DeepGEMM's indexer does; 4 steps for 128-byte keys): the
scores differ from FP32 sums of the products by about 2^-13 of the products' magnitude.

Nothing is read before griddepcontrol.wait (PDL); the top-k kernel's launch is released once
every CTA has written its keys.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.index import ptx as index_ptx
from jax_sparse_mla.kernel.index.config import (
    DIM,
    HEADS,
    K_STEPS,
    KEYS_OFFSET,
    LIVE_OFFSET,
    QUERY_OFFSET,
    SCALES_OFFSET,
    SCORE_SMEM_MAX,
    SCORE_THREADS,
    SCORE_WARPGROUPS,
    STAGES,
    TILE_BYTES,
    TOKENS,
)

PIECES = DIM // 16  # 16-byte pieces of a key or query row
TILE_PIECES = TOKENS * PIECES
WG_THREADS = 128  # a warpgroup: the copies, MMAs and epilogue of its own tiles
LOADS = TILE_PIECES // WG_THREADS  # pieces of a key tile per thread
LOOKUPS = LOADS + 1  # block-table entries a thread reads per tile: its copy rows, a scale row
STRIDE = SCORE_WARPGROUPS * TOKENS  # tokens from one of a warpgroup's tiles to its next
ACC = HEADS // 2  # accumulators per thread (m64n64)
SWIZZLE_128B = 1
assert SCORE_THREADS % (8 * PIECES) == 0 and SCORE_THREADS % HEADS == 0  # the prologue's copies
SIGN = -(2**31)


@cute.jit
def row_limit(length, rank, t, steps, capacity, dcp_size):
    """How many of this rank's cache positions verify row t of a request of ``length`` scores:
    index_validation.row_limits in-kernel (the global limit clamp(clamp(length, 0, D * C) - T
    + t + 1, 0, D * C), then this rank's positions j < it with j * D + rank below it)."""
    context = min(max(length, 0), dcp_size * capacity)
    return (max(context - steps + 1 + t, 0) - rank + dcp_size - 1) // dcp_size


@cute.jit
def swizzled(row, piece):
    """Offset of 16-byte piece ``piece`` of row ``row`` in a K-major tile of 128-byte rows
    with wgmma's 128-byte swizzle (8-row atoms, pieces XOR-ed by the row)."""
    return row * DIM + ((piece ^ (row % 8)) * 16)


class WarpgroupRing(NamedTuple):
    """A warpgroup's key-tile ring and what filling it needs: the cache (keys, key scales,
    its sizes, the block table and its walk state, ``blocks`` the read-ahead block-table
    entries), the warpgroup's tiles (``first``, then every SCORE_WARPGROUPS-th, ``mine`` of
    them), its slots from ``ring`` and their shared-memory regions, and the thread's index in
    the warpgroup."""

    keys: Any
    key_scales: Any
    capacity: Any
    block_size: Any
    num_blocks: Any
    whole: Any
    table: Any
    walk: Any
    blocks: Any
    first: Any
    mine: Any
    ring: Any
    sKeys: Any
    sScales: Any
    sLive: Any
    tid: Any


@cute.jit
def weight_slot(head):
    """Where a head tile's weight of head ``head`` is staged: the epilogue's lane quad q reads
    its 16 weights (heads 8 j + 2 q and + 1, j < 8) as four 16-byte words, word k (at 4 k + q)
    holding heads 16 k + 2 q, + 1, 16 k + 8 + 2 q, + 1 (one shared-memory wavefront per warp
    and word, half the loads of pairs)."""
    j, quad = head // 8, (head % 8) // 2
    return (4 * (j // 2) + quad) * 4 + (j % 2) * 2 + head % 2


@cute.jit
def order_key(score, live):
    """The 32-bit key whose unsigned order is the selection's: higher score higher, -0.0 as
    +0.0, NaN (1) below every number, 0 where ``live`` is 0 (no candidate)."""
    bits = index_ptx.float_bits(score)
    bits = ptx.where_i32(bits == SIGN, 0, bits)
    key = ptx.where_i32(bits < 0, bits ^ -1, bits | SIGN)
    key = ptx.where_i32((bits & 0x7FFFFFFF) > 0x7F800000, 1, key)
    return ptx.where_i32(live != 0, key, 0)


class IndexScores:
    """Order keys of every (verify row, token) of B requests (ABI: config.SCORE_PARAMS)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Pointer,
        mWeights: cute.Pointer,
        mKeys: cute.Pointer,
        mKeyScales: cute.Pointer,
        mTable: cute.Pointer,
        mLengths: cute.Pointer,
        mRank: cute.Pointer,
        mOrder: cute.Pointer,
        steps: Int32,
        head_tiles: Int32,
        block_size: Int32,
        num_blocks: Int32,
        max_blocks: Int32,
        pitch: Int32,
        span: Int32,
        dcp_size: Int32,
    ):
        self.kernel(
            mQ,
            mWeights,
            mKeys,
            mKeyScales,
            mTable,
            mLengths,
            mRank,
            mOrder,
            steps,
            head_tiles,
            block_size,
            num_blocks,
            max_blocks,
            pitch,
            span,
            dcp_size,
        ).launch(
            grid=(1, 1, 1),
            block=(SCORE_THREADS, 1, 1),
            smem=SCORE_SMEM_MAX,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Pointer,
        mWeights: cute.Pointer,
        mKeys: cute.Pointer,
        mKeyScales: cute.Pointer,
        mTable: cute.Pointer,
        mLengths: cute.Pointer,
        mRank: cute.Pointer,
        mOrder: cute.Pointer,
        steps: Int32,
        head_tiles: Int32,
        block_size: Int32,
        num_blocks: Int32,
        max_blocks: Int32,
        pitch: Int32,
        span: Int32,
        dcp_size: Int32,
    ):
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(SCORE_SMEM_MAX, 1024).toint()
        sKeys, sScales, sLive = base + KEYS_OFFSET, base + SCALES_OFFSET, base + LIVE_OFFSET
        sQuery = base + QUERY_OFFSET
        heads = head_tiles * HEADS
        query_tiles = steps * head_tiles
        sWeights = sQuery + query_tiles * TILE_BYTES
        tid, _, _ = cute.arch.thread_idx()
        x, b, _ = cute.arch.block_idx()
        # Warpgroup wg takes the CTA's tiles wg, wg + SCORE_WARPGROUPS, .. through its own
        # ring of STAGES buffers; wtid is the thread's index in it.
        wg, wtid = tid // WG_THREADS, tid % WG_THREADS
        ring = wg * STAGES
        cute.arch.griddepcontrol_wait()

        # The prologue's reads are independent of each other: the request's length and the
        # rank, the first tiles' block-table entries and the queries all go out before any
        # is waited on (one round trip, not a chain).
        first = x * span + wg  # this warpgroup's first tile; then every SCORE_WARPGROUPS-th
        length = ptx.load_global_i32(mLengths.toint() + Int64(b) * 4)
        rank = ptx.load_global_i32(mRank.toint())
        table = mTable.toint() + Int64(b) * max_blocks * 4
        capacity = max_blocks * block_size
        # Every tile inside one block (blocks of whole key tiles, as in DeepSeek V3.2's
        # cache, or a flat cache: one block): one table entry per tile, no per-row division.
        whole = (block_size % TOKENS == 0) | (max_blocks == 1)
        # There the warpgroup's tiles (STRIDE tokens apart) are walked as (block index,
        # offset in the block): a conditional subtraction per tile, no division.
        cursor = cute.make_rmem_tensor((2,), Int32)
        cursor[0] = first * TOKENS // block_size
        cursor[1] = first * TOKENS - cursor[0] * block_size
        stride_blocks = STRIDE // block_size
        stride_offset = STRIDE - stride_blocks * block_size
        walk = (cursor, stride_blocks, stride_offset)
        # A tile's block-table entries are read one tile ahead of its copies (the first
        # STAGES - 1 tiles' all at once), so that their latency never stalls the loop.
        starts = [cute.make_rmem_tensor((LOOKUPS,), Int32) for _ in range(STAGES - 1)]
        for s in cutlass.range_constexpr(STAGES - 1):
            tile = first + s * SCORE_WARPGROUPS
            self.lookup(table, capacity, block_size, whole, walk, tile, wtid, starts[s])
        blocks = cute.make_rmem_tensor((LOOKUPS,), Int32)
        ahead_tile = first + (STAGES - 1) * SCORE_WARPGROUPS
        self.lookup(table, capacity, block_size, whole, walk, ahead_tile, wtid, blocks)
        # The request's query tiles and weights (contiguous in global memory), by all threads.
        # A thread copies the same piece of every (SCORE_THREADS / PIECES)-th row of the
        # query tiles (contiguous rows; a multiple of 8 apart: one swizzle phase) and the same
        # head's weight of every head tile: its addresses only advance, no index math per copy.
        q_src = mQ.toint() + Int64(b) * query_tiles * TILE_BYTES + tid * 16
        q_dst = sQuery + swizzled(tid // PIECES, tid % PIECES)
        for i in cutlass.range(0, query_tiles * TILE_PIECES - tid, SCORE_THREADS, unroll=1):
            index_ptx.cp_async_16(q_dst + i * 16, q_src + Int64(i) * 16, 16)
        w_src = mWeights.toint() + Int64(b) * steps * heads * 4 + tid * 4
        w_dst = sWeights + (tid - tid % HEADS + weight_slot(tid % HEADS)) * 4
        for i in cutlass.range(0, steps * heads - tid, SCORE_THREADS, unroll=1):
            index_ptx.cp_async_4(w_dst + i * 4, w_src + Int64(i) * 4, 4)
        longest = row_limit(length, rank, steps - 1, steps, capacity, dcp_size)
        # The CTA's tiles [x * span, + count); this warpgroup's share of them.
        count = max(min(span, (longest + TOKENS - 1) // TOKENS - x * span), 0)
        mine = max(count - wg + SCORE_WARPGROUPS - 1, 0) // SCORE_WARPGROUPS

        for s in cutlass.range_constexpr(STAGES - 1):
            if s < mine:
                self.load_tile(
                    mKeys, mKeyScales, capacity, block_size, num_blocks, whole,
                    first + s * SCORE_WARPGROUPS, starts[s], sKeys + (ring + s) * TILE_BYTES,
                    sScales + (ring + s) * TOKENS * 4, sLive + (ring + s) * TOKENS * 4, wtid,
                )  # fmt: skip
            index_ptx.cp_async_commit()  # the first group also holds the queries' copies
        # Every thread's query copies landed and are seen by both warpgroups' wgmma.
        index_ptx.cp_async_wait(STAGES - 2)
        ptx.fence_proxy_async_shared()
        cute.arch.sync_threads()
        out = mOrder.toint() + Int64(b) * steps * pitch * 4
        tiles = WarpgroupRing(
            mKeys, mKeyScales, capacity, block_size, num_blocks, whole, table, walk, blocks,
            first, mine, ring, sKeys, sScales, sLive, wtid,
        )  # fmt: skip
        if steps * head_tiles == 1:
            self.single_unit_tiles(tiles, sQuery, sWeights, out, pitch)
        else:
            for i in cutlass.range(mine, unroll=1):
                index_ptx.cp_async_wait(STAGES - 2)  # tile i landed
                ptx.fence_proxy_async_shared()  # read by wgmma
                # The warpgroup's copies seen; its tile i - 1 consumed (its ring is its own).
                index_ptx.barrier_sync_id(1 + wg, WG_THREADS)
                self.load_ahead(tiles, i + STAGES - 1)
                stage = ring + i % STAGES
                self.score_tile(
                    sKeys + stage * TILE_BYTES, sScales + stage * TOKENS * 4,
                    sLive + stage * TOKENS * 4, sQuery, sWeights, steps, head_tiles, out,
                    pitch, (first + i * SCORE_WARPGROUPS) * TOKENS, wtid,
                )  # fmt: skip
        index_ptx.cp_async_wait(0)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def load_ahead(self, r: WarpgroupRing, ahead):
        """Starts the copies of the warpgroup's tile ``ahead`` (if it has one) into its ring
        slot, closes the cp.async group (one per call, empty or not) and reads the block-table
        entries of the tile after it."""
        if ahead < r.mine:
            stage = r.ring + ahead % STAGES
            self.load_tile(
                r.keys, r.key_scales, r.capacity, r.block_size, r.num_blocks, r.whole,
                r.first + ahead * SCORE_WARPGROUPS, r.blocks, r.sKeys + stage * TILE_BYTES,
                r.sScales + stage * TOKENS * 4, r.sLive + stage * TOKENS * 4, r.tid,
            )  # fmt: skip
        index_ptx.cp_async_commit()
        next_tile = r.first + (ahead + 1) * SCORE_WARPGROUPS
        self.lookup(r.table, r.capacity, r.block_size, r.whole, r.walk, next_tile, r.tid,
                    r.blocks)  # fmt: skip

    @cute.jit
    def single_unit_tiles(self, r: WarpgroupRing, sQuery, sWeights, out, pitch):
        """The warpgroup's tiles when the request has one unit (T = 1, up to 64 heads), each
        tile's MMAs issued before the previous tile's epilogue, which they overlap (the units
        of one tile cannot: they share the tile's one wgmma group). Tiles alternate between
        two accumulator sets, two per loop iteration, so that no set is live across its own
        next MMA (a copy of in-flight accumulators would make ptxas serialize every wgmma of
        the kernel). Tile i + 1 must have landed one step earlier than in the general loop;
        the ring's copies still run STAGES - 1 tiles ahead of the tile being finished."""
        finish = (r, sWeights, out, pitch)
        if r.mine > 0:
            ptx.wgmma_fence()
            even = self.mma(r.sKeys + r.ring * TILE_BYTES, sQuery, 0, 1)  # tile 0: seen
            for j in cutlass.range((r.mine - 1) // 2, unroll=1):
                odd = self.next_tile_mma(r, sQuery, 2 * j)
                self.finish_tile(ptx.pin_f32(even), 2 * j, *finish)
                even = self.next_tile_mma(r, sQuery, 2 * j + 1)
                self.finish_tile(ptx.pin_f32(odd), 2 * j + 1, *finish)
            last = r.mine - 1
            if (r.mine - 1) % 2 == 1:
                odd = self.next_tile_mma(r, sQuery, last - 1)
                self.finish_tile(ptx.pin_f32(even), last - 1, *finish)
                ptx.wgmma_wait(0)
                self.finish_tile(ptx.pin_f32(odd), last, *finish)
            else:
                ptx.wgmma_wait(0)
                self.finish_tile(ptx.pin_f32(even), last, *finish)

    @cute.jit
    def next_tile_mma(self, r: WarpgroupRing, sQuery, i):
        """With tile i's MMAs in flight: waits until tile i + 1 landed, moves the ring on,
        issues tile i + 1's MMAs and waits for tile i's (returns tile i + 1's accumulators,
        in flight)."""
        wg = r.ring // STAGES
        index_ptx.cp_async_wait(1)  # tile i + 1 landed (groups: tiles .. i + 2)
        ptx.fence_proxy_async_shared()  # read by wgmma
        # Every thread's copies of tile i + 1 seen; tile i - 1 finished (its MMAs waited for,
        # its scales read), so its slot takes tile i + 3.
        index_ptx.barrier_sync_id(1 + wg, WG_THREADS)
        self.load_ahead(r, i + STAGES - 1)
        ptx.wgmma_fence()
        s = self.mma(r.sKeys + (r.ring + (i + 1) % STAGES) * TILE_BYTES, sQuery, 0, 1)
        ptx.wgmma_wait(1)  # tile i's MMAs done; tile i + 1's in flight
        return s

    @cute.jit
    def finish_tile(self, s, i, r: WarpgroupRing, sWeights, out, pitch):
        """The epilogue of a request's one unit on the warpgroup's tile i: its tokens' order
        keys."""
        stage = r.ring + i % STAGES
        position = (r.first + i * SCORE_WARPGROUPS) * TOKENS
        token, totals, stores = self.epilogue_state(
            r.sScales + stage * TOKENS * 4, r.sLive + stage * TOKENS * 4, out, pitch, position,
            r.tid,
        )  # fmt: skip
        self.epilogue(s, totals, token, sWeights, 1, stores, 0, 0, r.tid)

    @cute.jit
    def lookup(self, table, capacity, block_size, whole, walk, tile, tid, blocks):
        """Starts the reads of the block-table entries of this thread's rows of key tile
        ``tile`` into ``blocks`` (0 outside the capacity), consumed by the next load_tile:
        with ``whole`` (every tile inside one block) the tile's one entry and (blocks[1]) its
        offset in the block, from ``walk``'s cursor, which moves on to the warpgroup's next
        tile (lookups go in tile order); else its LOADS copy rows', then its scale row's."""
        if whole:
            cursor, stride_blocks, stride_offset = walk
            blocks[0] = ptx.load_global_i32_if(
                tile * TOKENS < capacity, table + Int64(cursor[0]) * 4
            )
            blocks[1] = cursor[1]
            offset = cursor[1] + stride_offset
            wrap = offset >= block_size
            cursor[0] = cursor[0] + stride_blocks + ptx.where_i32(wrap, 1, 0)
            cursor[1] = ptx.where_i32(wrap, offset - block_size, offset)
        else:
            for i in cutlass.range_constexpr(LOOKUPS):
                position = tile * TOKENS + self.row(tid, i)
                entry = table + Int64(position // block_size) * 4
                blocks[i] = ptx.load_global_i32_if(position < capacity, entry)

    @cute.jit
    def row(self, tid, i: int):
        """The tile row of this thread's lookup i: its copy rows, then (i == LOADS) its
        scale row (threads < TOKENS)."""
        if cutlass.const_expr(i < LOADS):
            return (tid + WG_THREADS * i) // PIECES
        return tid % TOKENS

    @cute.jit
    def load_tile(
        self, mKeys, mKeyScales, capacity, block_size, num_blocks, whole, tile, blocks, sK, sS,
        sL, tid,
    ):  # fmt: skip
        """cp.async of key tile ``tile`` (its rows through the block-table entries
        ``blocks``, zero-filled where the block is outside the cache) into sK, its key scales
        into sS and live flags into sL."""
        if whole:
            self.load_whole_tile(
                mKeys, mKeyScales, capacity, block_size, num_blocks, tile, blocks[0],
                blocks[1], sK, sS, sL, tid,
            )  # fmt: skip
        else:
            for i in cutlass.range_constexpr(LOOKUPS):
                row = self.row(tid, i)
                position = tile * TOKENS + row
                block = blocks[i]
                live = (position < capacity) & (block >= 0) & (block < num_blocks)
                src = Int64(block) * block_size + position % block_size
                self.copy_row(mKeys, mKeyScales, src, live, row, i, sK, sS, sL, tid)

    @cute.jit
    def load_whole_tile(
        self, mKeys, mKeyScales, capacity, block_size, num_blocks, tile, block, offset, sK, sS,
        sL, tid,
    ):  # fmt: skip
        """load_tile of a tile inside one block (``block``, from token ``offset`` of it): one
        block check for the tile, and the thread's copies at constant offsets from the tile's
        first cache row (its 16-byte pieces (tid + WG_THREADS * i) of the tile, which is
        contiguous). A row past the capacity (a flat cache's last, partial tile) is not
        read."""
        start = tile * TOKENS
        live = (block >= 0) & (block < num_blocks)
        first = Int64(block) * block_size + offset  # the tile's first cache row
        if start + TOKENS <= capacity:
            # Outside the cache: no byte is read (source size 0), from an address kept in it.
            keys = mKeys.toint() + ptx.where_i64(live, first * DIM, 0) + tid * 16
            for i in cutlass.range_constexpr(LOADS):
                piece = tid + WG_THREADS * i
                dst = sK + swizzled(piece // PIECES, piece % PIECES)
                index_ptx.cp_async_16(dst, keys + WG_THREADS * 16 * i, ptx.where_i32(live, 16, 0))
            row = self.row(tid, LOADS)
            self.copy_row(mKeys, mKeyScales, first + row, live, row, LOADS, sK, sS, sL, tid)
        else:  # rows past the capacity (a flat cache's last tile, or none at all) stay unread
            for i in cutlass.range_constexpr(LOOKUPS):
                row = self.row(tid, i)
                self.copy_row(mKeys, mKeyScales, first + row, live & (start + row < capacity),
                              row, i, sK, sS, sL, tid)  # fmt: skip

    @cute.jit
    def copy_row(self, mKeys, mKeyScales, src, live, row, i: int, sK, sS, sL, tid):
        """This thread's copy i of a tile: a 16-byte piece of key row ``row`` from cache row
        ``src`` (i < LOADS), or (i == LOADS, threads < TOKENS) its key scale and live flag;
        zero-filled, without a read, where not ``live``."""
        if cutlass.const_expr(i < LOADS):
            piece = (tid + WG_THREADS * i) % PIECES
            addr = mKeys.toint() + ptx.where_i64(live, src * DIM + piece * 16, 0)
            index_ptx.cp_async_16(sK + swizzled(row, piece), addr, ptx.where_i32(live, 16, 0))
        elif tid < TOKENS:
            addr = mKeyScales.toint() + ptx.where_i64(live, src * 4, 0)
            index_ptx.cp_async_4(sS + row * 4, addr, ptx.where_i32(live, 4, 0))
            ptx.store_shared_u32(sL + row * 4, ptx.where_i32(live, 1, 0))

    @cute.jit
    def score_tile(
        self, sK, sS, sL, sQuery, sWeights, steps, head_tiles, out, pitch, position, tid
    ):
        """Every verify row's order keys of one key tile (tokens ``position`` ..). The T x G
        (verify row, head tile) units go two at a time, as one wgmma of N = 128 (the key tile
        read from shared memory once per pair); an odd count's last unit (T = 1, up to 64
        heads: the only one) goes alone. The CTA's other warpgroup and the SM's other CTA
        overlap a pair's MMAs with their epilogues."""
        units = steps * head_tiles
        token, totals, stores = self.epilogue_state(sS, sL, out, pitch, position, tid)
        g = Int32(0)  # the next unit's head tile
        for unit in cutlass.range(0, units - units % 2, 2, unroll=1):
            g1 = self.next_tile(g, head_tiles)
            ptx.wgmma_fence()
            pair = self.mma(sK, sQuery, unit, 2)
            ptx.wgmma_wait(0)
            pair = ptx.pin_f32(pair)
            self.epilogue(pair[:ACC], totals, token, sWeights, head_tiles, stores, unit, g, tid)
            self.epilogue(pair[ACC:], totals, token, sWeights, head_tiles, stores, unit + 1, g1,
                          tid)  # fmt: skip
            g = self.next_tile(g1, head_tiles)
        if units % 2 == 1:
            ptx.wgmma_fence()
            s = self.mma(sK, sQuery, units - 1, 1)
            ptx.wgmma_wait(0)
            s = ptx.pin_f32(s)
            self.epilogue(s, totals, token, sWeights, head_tiles, stores, units - 1, g, tid)

    @cute.jit
    def epilogue_state(self, sS, sL, out, pitch, position, tid):
        """What ``epilogue`` carries over a key tile's units (tokens ``position`` ..): the key
        scale and live flag of the token whose keys this thread stores (lane quad r < 2:
        token r of its two), read once for all verify rows; its two tokens' sums, zero; and
        where the token's key of the next verify row goes, with the row pitch in bytes (the
        destination moves on a row after each row's last head tile: the units go row by
        row)."""
        lane = tid % 32
        row = 16 * (tid // 32) + lane // 4 + 8 * (lane % 2)
        token = (ptx.load_shared_f32(sS + row * 4), ptx.load_shared_u32(sL + row * 4))
        totals = cute.make_rmem_tensor((2,), Float32)
        totals.fill(0.0)
        destination = cute.make_rmem_tensor((1,), Int64)
        destination[0] = out + Int64(position + row) * 4
        return token, totals, (destination, Int64(pitch) * 4)

    @cute.jit
    def next_tile(self, g, head_tiles):
        """The head tile of the unit after one of head tile g."""
        return ptx.where_i32(g == head_tiles - 1, 0, g + 1)

    @cute.jit
    def mma(self, sK, sQuery, unit, count: int):
        """S = K Q^T of the key tile and ``count`` consecutive query tiles from ``unit``
        (verify row t, head tile g at t * G + g; contiguous in shared memory, so one wgmma
        group of N = 64 * count covers them and reads the key tile once), committed as one
        wgmma group, not waited for: accumulators [ACC * i, + ACC) belong to unit + i."""
        # The k-th step's descriptors: the start address field (16-byte units, far below its
        # 14-bit limit) advanced by 32 bytes per step, without rebuilding the descriptor.
        desc_k = ptx.smem_descriptor(sK, 16, 8 * DIM, SWIZZLE_128B)
        desc_q = ptx.smem_descriptor(sQuery + unit * TILE_BYTES, 16, 8 * DIM, SWIZZLE_128B)
        s = None
        for k in cutlass.range_constexpr(K_STEPS):
            s = index_ptx.wgmma_e4m3_ss(s, desc_k + 2 * k, desc_q + 2 * k, n=ACC * count)
        ptx.wgmma_commit()
        return s

    @cute.jit
    def epilogue(self, s, totals, token, sWeights, head_tiles, stores, unit, g, tid):
        """Adds sum_h w[t, h] relu(S) of ``unit`` (verify row t, head tile g) to ``totals``
        (this thread's two tokens); after the row's last head tile, the order key of ``token``
        (its key scale and live flag) leaves for ``stores``' destination, which moves on to
        the next row."""
        quad = tid % 4
        # Value v: token 16 warp + lane / 4 + 8 ((v / 2) % 2), head 8 (v / 4) + 2 quad + v % 2
        # of this head tile; the weights of heads 8 j + 2 quad (+ 1) at weight_slot's places.
        w_row = sWeights + unit * HEADS * 4
        for k in cutlass.range_constexpr(ACC // 8):
            weights = ptx.load_shared_v4_f32(w_row + (4 * k + quad) * 16)
            for half in cutlass.range_constexpr(2):
                j = 2 * k + half
                w0, w1 = weights[2 * half], weights[2 * half + 1]
                for r in cutlass.range_constexpr(2):
                    low = index_ptx.relu_nan(s[4 * j + 2 * r])
                    high = index_ptx.relu_nan(s[4 * j + 2 * r + 1])
                    totals[r] = totals[r] + w0 * low + w1 * high
        if g == head_tiles - 1:
            reduced = []
            for r in cutlass.range_constexpr(2):
                total = totals[r]
                for shift in cutlass.range_constexpr(2):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << shift)
                reduced.append(total)
            # Lane quad r < 2 stores token r's key: one store path for both (a branch per
            # token diverged, every warp running both).
            destination, row_bytes = stores
            if quad < 2:
                scale, live = token
                key = order_key(scale * ptx.where(quad == 0, reduced[0], reduced[1]), live)
                ptx.store_global_b32(destination[0], key)
            destination[0] = destination[0] + row_bytes
            totals.fill(0.0)
