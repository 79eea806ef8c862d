/* A memory copy with streaming (non-temporal) stores: see host_copy.py for why.
 *
 * x86-64 only (SSE2, which every x86-64 CPU has). The destination lines are
 * written whole, without being read into the cache first. Streaming stores are
 * weakly ordered: the closing sfence makes them visible before any later store
 * of this thread (e.g. the message that hands the buffer to the writer process).
 */
#include <emmintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

void fastpersist_stream_copy(void *dest, const void *source, size_t n)
{
    char *d = dest;
    const char *s = source;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;  /* bytes until d is 16-byte aligned */

    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence();
}
