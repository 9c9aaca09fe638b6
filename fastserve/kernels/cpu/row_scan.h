/* A float32 row scan shared by the greedy and grammar-mask kernels (greedy.c, token_mask.c).
 * fastserve/kernels/cpu_ops.py keys its build cache on the headers in this folder. */
#ifndef FASTSERVE_ROW_SCAN_H
#define FASTSERVE_ROW_SCAN_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The first index of x[0 .. vocab) equal to m (torch.argmax's answer once m is the row's maximum),
 * or -1 where none is: only a row holding a NaN. */
static inline int64_t first_index_of(const float *x, int64_t vocab, float m) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= vocab; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < vocab; ++i)
        if (x[i] == m) return i;
    return -1;
}

#endif
