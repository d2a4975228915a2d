/* Test infrastructure (testing/slurm.py): preloaded into slurmd in a test host, so that sysinfo()
 * reports the uptime since the container booted, not since the machine did (slurmctld checks that a
 * node it asked to reboot reports an uptime younger than the request). Two seconds are added to
 * the boot: a container reboots within the second of the request, a real machine never does. */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <unistd.h>
int sysinfo(struct sysinfo *info) {
    long rc = syscall(SYS_sysinfo, info);
    if (rc != 0) return (int)rc;
    FILE *f = fopen("/proc/1/stat", "r");
    if (f) {
        unsigned long long start = 0;
        int n = fscanf(f, "%*d %*s %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &start);
        fclose(f);
        long tick = sysconf(_SC_CLK_TCK);
        if (n == 1 && tick > 0 && (unsigned long long)info->uptime >= start / tick) {
            long up = info->uptime - (long)(start / tick);
            info->uptime = up > 2 ? up - 2 : 0;  /* slurmd starts within 2 s of a boot, too */
        }
    }
    return 0;
}
