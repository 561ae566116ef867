"""WAN emulation: regions as network namespaces joined by shaped links (DESIGN §5).

A layer of its own, below the faults of :mod:`ddiloco.chaos` and above the workers: plain
``ddiloco run --regions`` uses it with no fault at all, and the chaos runner's partition and
congest faults act on the same regions. It imports nothing from the rest of ``ddiloco.chaos``.

* :mod:`~ddiloco.chaos.wan.topology` - the topology file (regions, links, placement);
* :mod:`~ddiloco.chaos.wan.netns` - namespace, veth and command helpers;
* :mod:`~ddiloco.chaos.wan.regions` - :class:`Regions`: namespaces, HTB rates, the delay
  line and nftables loss in force for a run, and their link checks;
* :mod:`~ddiloco.chaos.wan.regions_cli` - the ``ddiloco regions`` command and its tables;
* :mod:`~ddiloco.chaos.wan.delayer` - the NFQUEUE one-way delay line (a process per region);
* :mod:`~ddiloco.chaos.wan.router` - a compose region's router (the same links in containers);
* :mod:`~ddiloco.chaos.wan.probes` - link probes run inside the namespaces;
* :mod:`~ddiloco.chaos.wan.bandwidth` - the bandwidth a run needs per link;
* :mod:`~ddiloco.chaos.wan.session` - regions for a run's lifetime and what crossed them.
"""
