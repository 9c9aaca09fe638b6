/* Sampling's inverse-CDF draw over float32 probabilities on the CPU: for each row, the first index
 * whose float64 running sum passes u * total, or reaches the total (rounding can put the point at
 * the total itself), where total is the row's float64 sum.
 *
 * Why our own: torch writes the whole float64 CDF (a widening copy, then the running sum, 400 KB
 * a row of SmolLM2's 49,152 tokens) and searches it twice; here the running sum is kept only at
 * every DRAW_BLOCK-th token, and the second pass walks the one block the point falls in. The sums
 * are the same sequential float64 additions in token order as torch.cumsum's (no reassociation:
 * no -ffast-math), so the index is the same; a zero is skipped, which leaves a float64 sum
 * unchanged, so a row that top-k or top-p left with few tokens costs a compare per token.
 *
 * ok[r] = whether row r's total is finite and positive (without, its token is 0, to ignore).
 * Rows are shared out over num_threads OpenMP threads. Built by fastserve/kernels/cpu_draw.py with
 * the attention kernel's compiler and flags; plain C, no ISA-specific path.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#define DRAW_BLOCK 1024

int draw_available(void) { return 1; }

int64_t draw_block(void) { return DRAW_BLOCK; }

static int64_t draw_row(const float *p, int64_t vocab, double u, double *starts, uint8_t *ok) {
    double sum = 0.0;
    for (int64_t b = 0; b * DRAW_BLOCK < vocab; ++b) {
        starts[b] = sum;
        const int64_t end = (b + 1) * DRAW_BLOCK < vocab ? (b + 1) * DRAW_BLOCK : vocab;
        for (int64_t i = b * DRAW_BLOCK; i < end; ++i)
            if (p[i] != 0.0f)
                sum += (double)p[i];
    }
    const double total = sum;
    *ok = total > 0.0 && isfinite(total);
    if (!*ok)
        return 0;
    const double point = u * total;
    /* The first block whose end sum passes the point or reaches the total holds the index. */
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    int64_t b = 0;
    while (b + 1 < blocks && !(starts[b + 1] > point || starts[b + 1] >= total))
        ++b;
    sum = starts[b];
    const int64_t end = (b + 1) * DRAW_BLOCK < vocab ? (b + 1) * DRAW_BLOCK : vocab;
    for (int64_t i = b * DRAW_BLOCK; i < end; ++i) {
        if (p[i] != 0.0f)
            sum += (double)p[i];
        if (sum > point || sum >= total)
            return i;
    }
    return end - 1;   /* not reached: the last token's sum is the total */
}

/* tokens[r], ok[r] for each row of probs [rows][vocab] float32 (rows row_stride floats apart) with
 * row r's variate uniforms[r]; scratch holds rows * ceil(vocab / DRAW_BLOCK) doubles. Returns 0. */
int draw_rows(const float *probs, int64_t rows, int64_t vocab, int64_t row_stride, const double *uniforms,
              double *scratch, int64_t *tokens, uint8_t *ok, int num_threads) {
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows > 1)")
    for (int64_t r = 0; r < rows; ++r)
        tokens[r] = draw_row(probs + r * row_stride, vocab, uniforms[r], scratch + r * blocks, ok + r);
    return 0;
}
