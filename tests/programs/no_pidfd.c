/* Preloaded before the shim: pidfd_open(2) fails with ENOSYS, as on a kernel before 5.3 or
 * under a seccomp profile without it; every other syscall(2) goes through.  The shim must
 * then find its pid namespace from /proc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

long syscall(long number, ...)
{
    va_list ap;
    long a[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_pidfd_open) {
        errno = ENOSYS;
        return -1;
    }
    long (*real)(long, ...) = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
