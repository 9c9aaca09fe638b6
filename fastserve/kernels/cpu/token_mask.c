/* Structured outputs on the CPU: each row's grammar mask applied to float32 logits, in place,
 * and the masked row's greedy token.
 *
 * A mask is one bit per token id in little-endian 32-bit words (llguidance's bitmask): a token
 * whose bit is clear, or that lies past the mask's words, gets -inf. Why our own: torch's
 * masked_fill_ needs the bits unpacked to a byte per token, and the sampler then ran its greedy
 * pass over the whole batch again (docs/engine.md); here each 32-bit word is read
 * once and, with AVX-512, becomes two 16-lane blends (a word that allows all 32 tokens, the
 * common case inside a JSON string, writes nothing), and the row's first maximum (torch.argmax's
 * answer) is found while it is in cache. allowed[i] says whether row i's mask allows any token
 * (none: its grammar failed, and its job alone fails).
 *
 * Rows are shared out over num_threads OpenMP threads, as the greedy kernel's (it runs right
 * after the vocabulary projection, whose threads are awake). Built by
 * fastserve/kernels/cpu_token_mask.py with the attention kernel's compiler and flags; plain loops
 * where the compiler does not target AVX-512 (same results).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "row_scan.h"

int token_mask_available(void) { return 1; }

static int64_t first_max(const float *x, int64_t vocab) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= vocab; i += 16)
        vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < vocab; ++i)
        if (x[i] > m) m = x[i];
    const int64_t first = first_index_of(x, vocab, m);
    return first < 0 ? 0 : first;   /* a row that holds a NaN: the caller found it not finite before masking */
}

static uint8_t mask_row(float *x, int64_t vocab, const uint32_t *mask, int64_t words) {
    const int64_t covered = vocab < 32 * words ? vocab : 32 * words;
    uint32_t any = 0;
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; t + 32 <= covered; t += 32) {
        const uint32_t w = mask[t >> 5];
        any |= w;
        if (w == 0xFFFFFFFFu)
            continue;
        _mm512_storeu_ps(x + t, _mm512_mask_blend_ps((__mmask16)w, ninf, _mm512_loadu_ps(x + t)));
        _mm512_storeu_ps(x + t + 16, _mm512_mask_blend_ps((__mmask16)(w >> 16), ninf, _mm512_loadu_ps(x + t + 16)));
    }
#endif
    for (; t < covered; ++t) {
        const uint32_t bit = (mask[t >> 5] >> (t & 31)) & 1u;
        any |= bit;
        if (!bit)
            x[t] = -INFINITY;
    }
    for (; t < vocab; ++t)
        x[t] = -INFINITY;
    return any != 0;
}

/* For each i < n: row row_ids[i] of logits ([rows][vocab] float32, rows row_stride floats apart)
 * masked by masks[i * words ..], allowed[i] set, and tokens[i] its first maximum after the mask.
 * Returns 0. */
int mask_rows(float *logits, int64_t row_stride, int64_t vocab, const int64_t *row_ids, int64_t n,
              const uint32_t *masks, int64_t words, uint8_t *allowed, int64_t *tokens, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(n > 1)")
    for (int64_t i = 0; i < n; ++i) {
        float *row = logits + row_ids[i] * row_stride;
        allowed[i] = mask_row(row, vocab, masks + i * words, words);
        tokens[i] = first_max(row, vocab);
    }
    return 0;
}
