/* Preloaded before the shim: malloc, calloc and realloc called from the shim's own code
 * (libvgpu.so) fail, as when a process is out of memory at the moment the shim starts;
 * NO_HEAP_FOR_SHIM, where set, names the ones that fail ("calloc": only it).  Calls from
 * anywhere else (libc, the interpreter) are served by glibc's allocator.  The shim must
 * then refuse, not crash and not run uncapped. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

void *__libc_malloc(size_t);
void *__libc_calloc(size_t, size_t);
void *__libc_realloc(void *, size_t);

/* getenv does not allocate, so it is safe inside malloc */
static int fails(const char *function, const void *caller)
{
    const char *chosen = getenv("NO_HEAP_FOR_SHIM");
    if (chosen && !strstr(chosen, function))
        return 0;
    Dl_info info;
    if (!dladdr(caller, &info) || !info.dli_fname || !strstr(info.dli_fname, "libvgpu"))
        return 0;
    errno = ENOMEM;
    return 1;
}

void *malloc(size_t n)
{
    return fails("malloc", __builtin_return_address(0)) ? NULL : __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    return fails("calloc", __builtin_return_address(0)) ? NULL : __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    return fails("realloc", __builtin_return_address(0)) ? NULL : __libc_realloc(p, n);
}
