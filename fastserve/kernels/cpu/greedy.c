/* Greedy sampling's reductions over float32 logits on the CPU: each row's first maximum (what
 * torch.argmax returns) and whether every element of the row is finite.
 *
 * Why our own: torch's argmax over the last dimension does not vectorise its index-tracking
 * reduction on the CPU (docs/engine.md, "Greedy sampling in C"). Here a row is two passes: the
 * maximum and a finiteness flag (x - x is 0 for a finite x and NaN otherwise, summed), then the
 * first index equal to that maximum, which stops early.
 *
 * The token is torch.argmax's for a row without NaN, -inf and +inf included (a row masked with
 * -inf still has its greedy token); a row with a NaN gets finite = 0 and a token to ignore.
 * Rows are shared out over num_threads OpenMP threads. Built by fastserve/kernels/cpu_greedy.py with the
 * attention kernel's compiler and flags; the AVX-512 path where the compiler targets it, a plain
 * loop otherwise (same results).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "row_scan.h"

int greedy_available(void) { return 1; }

static int64_t row_argmax(const float *x, int64_t vocab, uint8_t *finite) {
    float m = -INFINITY;
    float bad = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY), vbad = _mm512_setzero_ps();
    for (; i + 16 <= vocab; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vm = _mm512_max_ps(vm, v);
        vbad = _mm512_add_ps(vbad, _mm512_sub_ps(v, v));
    }
    m = _mm512_reduce_max_ps(vm);
    bad = _mm512_reduce_add_ps(vbad);
#endif
    for (; i < vocab; ++i) {
        if (x[i] > m) m = x[i];
        bad += x[i] - x[i];
    }
    *finite = bad == 0.0f && vocab > 0;   /* bad is 0 exactly when every x is finite */
    return first_index_of(x, vocab, m);
}

/* tokens[r] = the first index of row r's maximum, finite[r] = whether row r is all finite, for
 * logits [rows][vocab] float32 with rows row_stride floats apart. Returns 0. */
int greedy_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t *tokens,
                uint8_t *finite, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows > 1)")
    for (int64_t r = 0; r < rows; ++r)
        tokens[r] = row_argmax(logits + r * row_stride, vocab, finite + r);
    return 0;
}
