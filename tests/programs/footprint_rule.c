/* Prints vgpu_alloc_footprint(size) for each size given on the command line: the rule in
 * csrc/footprint.h that simgpu holds and the shim charges. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "footprint.h"

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        printf("%" PRIu64 "\n", vgpu_alloc_footprint(strtoull(argv[i], NULL, 0)));
    return 0;
}
