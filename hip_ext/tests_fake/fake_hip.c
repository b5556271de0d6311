/* FAKE libamdhip64.so for tests (no GPU). Implements the three HIP calls hip_cumask.c uses.
 * FAKE_HIP_LOG=path : append one line per call: "<function> <word0hex> <word1hex> ..."
 * FAKE_HIP_FAIL=<function>[:<code>] : that function returns <code> (default 1 = hipErrorInvalidValue).
 * Streams are heap blocks holding a copy of the mask, so GetCUMask reads back what Create got. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t;
typedef struct fake_stream { uint32_t magic; uint32_t n; uint32_t words[]; } fake_stream;
#define FAKE_MAGIC 0x5EEDC0DEu

static void fake_log(const char* fn, uint32_t n, const uint32_t* words) {
    const char* path = getenv("FAKE_HIP_LOG");
    if (path == NULL || path[0] == '\0') return;
    FILE* f = fopen(path, "a");
    if (f == NULL) return;
    fputs(fn, f);
    for (uint32_t i = 0; words != NULL && i < n; i++) fprintf(f, " %08x", words[i]);
    fputc('\n', f);
    fclose(f);
}

static int fake_fail(const char* fn) {
    const char* spec = getenv("FAKE_HIP_FAIL");
    if (spec == NULL) return 0;
    size_t len = strlen(fn);
    if (strncmp(spec, fn, len) != 0 || (spec[len] != '\0' && spec[len] != ':')) return 0;
    return spec[len] == ':' ? atoi(spec + len + 1) : 1;
}

hipError_t hipExtStreamCreateWithCUMask(void** stream, uint32_t cuMaskSize, const uint32_t* cuMask) {
    fake_log("hipExtStreamCreateWithCUMask", cuMaskSize, cuMask);
    int rc = fake_fail("hipExtStreamCreateWithCUMask");
    if (rc) return rc;
    if (stream == NULL || cuMask == NULL || cuMaskSize == 0) return 1;
    fake_stream* s = malloc(sizeof(fake_stream) + cuMaskSize * sizeof(uint32_t));
    if (s == NULL) return 2; /* hipErrorOutOfMemory */
    s->magic = FAKE_MAGIC;
    s->n = cuMaskSize;
    memcpy(s->words, cuMask, cuMaskSize * sizeof(uint32_t));
    *stream = s;
    return 0;
}

hipError_t hipExtStreamGetCUMask(void* stream, uint32_t cuMaskSize, uint32_t* cuMask) {
    int rc = fake_fail("hipExtStreamGetCUMask");
    fake_stream* s = stream;
    if (!rc && (s == NULL || s->magic != FAKE_MAGIC || cuMask == NULL)) rc = 1;
    if (!rc) {
        for (uint32_t i = 0; i < cuMaskSize; i++) cuMask[i] = i < s->n ? s->words[i] : 0;
    }
    fake_log("hipExtStreamGetCUMask", rc ? 0 : cuMaskSize, cuMask);
    return rc;
}

hipError_t hipStreamDestroy(void* stream) {
    fake_log("hipStreamDestroy", 0, NULL);
    int rc = fake_fail("hipStreamDestroy");
    if (rc) return rc;
    fake_stream* s = stream;
    if (s == NULL || s->magic != FAKE_MAGIC) return 400; /* hipErrorInvalidHandle */
    s->magic = 0;
    free(s);
    return 0;
}
